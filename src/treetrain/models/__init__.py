"""Models: Hugging Face decoders run over a packed tree.

:mod:`.hf` registers the tree attention through transformers' public attention registry and runs
the decoder (:func:`~treetrain.models.hf.tree_forward`); :mod:`.recurrent` routes every state-carrying
layer along the tree (:mod:`.scan`: each node starts from its parent's final state, level by level;
:mod:`.pathconv`: convolution windows along each token's path; :mod:`.segment`: the same on a
segment of the tree, a context-parallel chunk or a depth-first node; the families: :mod:`.gdn` Gated
DeltaNet, :mod:`.kda` Kimi Delta Attention, :mod:`.shortconv` LFM2 short convolutions, :mod:`.mamba2`
Mamba2 SSD mixers, :mod:`.mamba` Mamba selective-scan mixers, :mod:`.lightning` MiniMax, :mod:`.rglru`
RecurrentGemma, :mod:`.rwkv`, :mod:`.xlstm`); :mod:`.alibi` runs the ALiBi decoders (BLOOM, MPT,
Falcon), whose attention is their own, with the bias at each token's path position; :mod:`.moe`
records router logits for the aux loss; :mod:`.lora` wraps a model with PEFT adapters; :mod:`.head`
derives the exact LM head (logit scales, final softcap) every scoring path uses; :mod:`.classes`
looks a module up in a table keyed by class name, through FSDP2's subclasses; :mod:`.support`
accepts only verified architectures and refuses the rest (and every unrouted recurrent layer) by name;
:mod:`.pretrained` resolves a model known by name (``smollm2-135m-instruct``, from the package index)
to a cached local directory.

May import: trees, data, attention.
"""
