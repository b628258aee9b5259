"""Training artefacts to plain Hugging Face model folders: a checkpoint step or a GGUF file (`hf_folder`), and the
`zero_to_fp32.py` script a checkpoints folder carries in place of DeepSpeed's (`zero_to_fp32`)."""
