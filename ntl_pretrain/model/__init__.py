"""The model: the HF causal LM under ZeRO-3 with its output head (`build`), and the attention it runs: whether
flash-attention imports (`flash_attention`) and the document boundaries its varlen kernel takes
(`document_attention`)."""

# transformers 5.25 turned `use_kernels` on by default in `from_pretrained`: it swaps layers for kernels fetched from
# the Hugging Face hub, which is code run from a download, absent on offline nodes, and refused on the meta device.
# Every model this package loads runs transformers' own layers, as `from_config` builds them, so a run started from
# `init_from` trains the same modules as one resumed from its checkpoint. On GPUs those kernels would also replace
# RMSNorm, MLP and linear layers (liger-kernels, megablocks) under ZeRO-3 without a word.
WITHOUT_HUB_KERNELS = {"use_kernels": False}
