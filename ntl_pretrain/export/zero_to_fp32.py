#!/usr/bin/env python
"""`zero_to_fp32.py` and `zero_to_torch.py` of a checkpoints folder written by ntl_pretrain, in place of the ones
DeepSpeed copies there (`checkpoint.save` writes this file under both names).

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization] [--dtype float32|bfloat16]

DeepSpeed's command lines, but OUTPUT_DIR becomes a Hugging Face model folder (config.json, tokenizer,
model.safetensors from the fp32 master weights, cast to `--dtype`) that `AutoModelForCausalLM.from_pretrained`
loads, as `ntl-pretrain export` writes it. DeepSpeed's own script would write the trainer module's state dict: keys
under the loss wrapper's `lm.` prefix, the output layer a second time under `head.`, and with
`--safe_serialization` it refuses the tied embedding ("Some tensors share memory").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero_to_fp32.py", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", help="the checkpoints folder (holding `latest`) or one step_<N> folder")
    parser.add_argument("output_dir", help="the Hugging Face folder to write")
    parser.add_argument("-t", "--tag", default=None, help="the step folder's name, e.g. step_300; default: latest")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="accepted for DeepSpeed's command line: the weights are always safetensors")  # fmt: skip
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty OUTPUT_DIR")
    args = parser.parse_args(argv)
    try:
        from ntl_pretrain.errors import InputError
        from ntl_pretrain.export.hf_folder import export_checkpoint
        from ntl_pretrain.outputs import check_output
    except ImportError:
        message = "this checkpoint was written by ntl_pretrain: install it (pip install ntl_pretrain) to convert it"
        print(f"zero_to_fp32.py: {message}", file=sys.stderr)
        return 1
    step = step_folder(Path(args.checkpoint_dir), args.tag)
    try:  # the folder is written whole and renamed into place: an existing one would be replaced, not merged
        check_output("output_dir", Path(args.output_dir), [step], args.overwrite, folder=True)
    except InputError as error:
        print(f"zero_to_fp32.py: {error}", file=sys.stderr)
        return 2
    print(export_checkpoint(step, args.output_dir, dtype=args.dtype))
    return 0


def step_folder(checkpoint_dir: Path, tag: str | None) -> Path:
    if tag is None and (checkpoint_dir / "hf_config").is_dir():
        return checkpoint_dir
    return checkpoint_dir / (tag or (checkpoint_dir / "latest").read_text().strip())


if __name__ == "__main__":
    sys.exit(main())
