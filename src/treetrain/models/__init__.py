"""Models: Hugging Face decoders run over a packed tree.

:mod:`.hf` registers the tree attention through transformers' public attention registry and runs
the decoder (:func:`~treetrain.models.hf.tree_forward`); :mod:`.recurrent` and :mod:`.gdn` route
Gated DeltaNet state along the tree; :mod:`.moe` records router logits for the aux loss;
:mod:`.lora` wraps a model with PEFT adapters; :mod:`.head` derives the exact LM head (logit scales,
final softcap) every scoring path uses; :mod:`.support` accepts only verified architectures and
refuses the rest (and every unrouted recurrent layer) by name; :mod:`.pretrained` resolves a model
known by name (``smollm2-135m-instruct``, from the package index) to a cached local directory.

May import: trees, data, attention.
"""
