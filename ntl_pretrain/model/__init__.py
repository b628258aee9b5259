"""The model: the HF causal LM under ZeRO-3 with its output head (`build`), and the attention it runs: whether
flash-attention imports (`flash_attention`) and the document boundaries its varlen kernel takes
(`document_attention`)."""
