"""Training: the loop (`trainer.Trainer`), one rank's entry (`main`, run as `python -m ntl_pretrain.train`), and the
rules for resuming a run folder (`resume_guard`)."""
