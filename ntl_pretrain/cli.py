"""`ntl-pretrain`: train (wraps the deepspeed launcher), export, convert-gguf, verify; eval, plot, study, data and
doctor come from the modules that own them."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ntl_pretrain.config.loading import dump_recipe, is_pipe, load_recipe_with_origins, read_stdin_recipe
from ntl_pretrain.config.recipe import Recipe, RecipeError
from ntl_pretrain.errors import InputError, OneLineParser, add_verbose, keep_standard_streams_open, run_reporting
from ntl_pretrain.outputs import check_output

if TYPE_CHECKING:
    from ntl_pretrain.preflight.start import RunStart

OWN_COMMANDS = ("train", "export", "convert-gguf", "verify")
# Commands that load torch, DeepSpeed and transformers: once they said their last line, the process ends at once,
# without the interpreter's teardown of those libraries (seconds on a busy machine, silent: a command seemed hung).
ENDS_AT_ONCE = ("train", "export", "convert-gguf", "eval")
# Commands that SIGTERM and SIGHUP end by their default action, not as an exception that unwinds the command
# (`errors.signals_end_the_command`): a study's worker threads would make it wait for every queued run first.
DEFAULT_STOP = ("study",)


class Delegated(NamedTuple):
    """A command its package owns: `arguments` names the module whose `register(subparsers, summary)` adds its
    arguments and imports nothing heavy, so that `ntl-pretrain <command> --help` answers at once; `runs` the
    `module:function` that runs it (torch, scipy: seconds to import), imported only then (None: `register` sets it)."""

    arguments: str
    summary: str
    runs: str | None = None


# `--help` lists them with their summaries and a mistyped command imports none of their modules.
DELEGATED_COMMANDS = {
    "eval": Delegated("ntl_pretrain.evaluation.arguments",
                      "validation CE/NTL and numeric generation metrics of a model",
                      "ntl_pretrain.evaluation.arguments:run"),
    "plot": Delegated("ntl_pretrain.plot", "loss, CE, NTL and numeric metrics of several runs in one PNG"),
    "study": Delegated("ntl_pretrain.study.arguments", "CE vs CE+NTL: train every variant x seed, evaluate, report",
                       "ntl_pretrain.study.commands:run_study"),
    "data": Delegated("ntl_pretrain.data.commands", "corpus tools: generate, train the tiny tokenizer, preview"),
    "doctor": Delegated("ntl_pretrain.doctor.arguments",
                        "check that this machine trains correctly (loss, collectives, speed, train/resume/export)",
                        "ntl_pretrain.doctor.commands:run_doctor"),
}  # fmt: skip


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() or 1


def train_command(args: argparse.Namespace, env: dict[str, str], verbose: bool = False) -> list[str]:
    """The deepspeed launcher command for a validated recipe on this machine, for ranks with environment `env`.
    Unless the recipe asks for `logging.verbose`, the launcher logs errors only, not its INFO lines (world info,
    each spawned command and exit)."""
    from ntl_pretrain.runtime.process_group import free_port

    port = args.master_port or free_port()
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner"]  # the deepspeed of this interpreter's env
    log_level = [] if verbose else ["--log_level", "error"]
    return [*launcher, *device_selection(args.nproc, env), "--master_port", str(port), *log_level,
            "--module", "ntl_pretrain.train", str(recipe_path(args.recipe)), *args.overrides]  # fmt: skip


def recipe_path(recipe: str) -> Path:
    """The recipe's absolute path, as the launch hands it to the ranks and the console names it; a pipe's own name
    (`/dev/fd/N`, `/dev/stdin`), which resolves to nothing that can be read again."""
    return Path(recipe).absolute() if is_pipe(recipe) else Path(recipe).resolve()


DEVICE_VARIABLES = ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES")
PIPED_FOR_THE_RANKS = "<a temporary file holding the resolved recipe, written at launch>"


def shown_launch(args: argparse.Namespace, env: dict[str, str], verbose: bool) -> str:
    """The launch `train` makes, as `--dry-run` prints it for a shell: the variables that choose the ranks' device
    (with DeepSpeed's CPU accelerator `--num_gpus` counts CPU processes), then the launcher command. A piped recipe
    reaches the ranks in a temporary file, its overrides applied (`launch`); a port drawn here is drawn again at
    launch unless `--master-port` fixes it."""
    settings = [f"{name}={env[name]}" for name in DEVICE_VARIABLES
                if name in env and (name == "DS_ACCELERATOR" or env[name] != os.environ.get(name))]  # fmt: skip
    if not is_pipe(args.recipe):
        return shlex.join([*settings, *train_command(args, env, verbose)])
    command = train_command(argparse.Namespace(**{**vars(args), "overrides": []}), env, verbose)
    return shlex.join([*settings, *command]).replace(shlex.quote(str(recipe_path(args.recipe))), PIPED_FOR_THE_RANKS)


def device_selection(nproc: int, env: dict[str, str]) -> list[str]:
    """`--include localhost:<the first nproc GPUs of CUDA_VISIBLE_DEVICES>` when the ranks run on GPUs and the
    variable narrows them, else `--num_gpus nproc`. DeepSpeed's runner puts `--num_gpus n` on GPUs 0..n-1 of the
    whole node, ignoring the variable: on a shared node, another job's GPUs."""
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if not visible or env.get("DS_ACCELERATOR") == "cpu":
        return ["--num_gpus", str(nproc)]
    devices = [device.strip() for device in visible.split(",")]
    if not all(device.isdigit() for device in devices):
        raise RecipeError(f"CUDA_VISIBLE_DEVICES={visible}: the deepspeed launcher selects GPUs by index; list "
                          f"indices (e.g. 4,5), not UUIDs")  # fmt: skip
    if nproc > len(devices):
        raise RecipeError(f"--nproc: {nproc} processes, but CUDA_VISIBLE_DEVICES={visible} makes {len(devices)} GPUs "
                          "visible")  # fmt: skip
    return ["--include", "localhost:" + ",".join(devices[:nproc])]


def checked_recipe(args: argparse.Namespace, stage: Callable[[str], None]) -> tuple[Recipe, RunStart]:
    """The recipe after every check a launch makes before any process starts (seconds: imports torch), and how the
    run starts; `stage` is told what is checked next."""
    stage("the libraries")
    from ntl_pretrain.config.deepspeed import load_run
    from ntl_pretrain.heads.architectures import check_recipe_architecture
    from ntl_pretrain.preflight.data import check_readers
    from ntl_pretrain.preflight.start import check_start
    from ntl_pretrain.preflight.world import check_world

    args.nproc = args.nproc or default_nproc()
    stage("the data files and the DeepSpeed config")
    recipe, ds_config = load_run(args.recipe, args.overrides, args.nproc)  # fail here, before any process starts
    tokenizer = check_world(recipe, args.master_port, stage)
    stage(f"the data at {args.nproc} process{'es' if args.nproc > 1 else ''}")
    check_readers(recipe, args.nproc)
    check_recipe_architecture(recipe)
    stage("the number tokens and the checkpoint the run resumes")
    return recipe, check_start(recipe, ds_config["train_batch_size"], args.nproc, tokenizer)


def run_train(args: argparse.Namespace) -> int:
    """Before launch and after, a console that fails (`| head`, `2>&-`, a full disk) costs lines, not the run
    (`errors.lossy_console`)."""
    if args.nproc is not None and args.nproc < 1:
        raise RecipeError(f"--nproc: must be >= 1 processes, got {args.nproc}")
    if args.recipe == "-":
        args.recipe = read_stdin_recipe()
    # a mistyped key is refused before torch is imported (seconds)
    origins = load_recipe_with_origins(args.recipe, args.overrides)[1]
    from ntl_pretrain.reporting.console import ongoing

    with ongoing(f"checking {args.recipe} before launch") as stage:
        try:
            recipe, start = checked_recipe(args, stage)
        except RecipeError as error:
            raise origins.overridden(error) from error
    from ntl_pretrain.optim.schedule import warmup_note

    for note in (warmup_note(recipe.schedule, recipe.train.max_steps), start.numbers_note):
        if note:
            print(f"ntl-pretrain: note: {note}", file=sys.stderr, flush=True)
    finished = f"{recipe.train.output_dir}: already at step {start.step} of train.max_steps=" \
        f"{recipe.train.max_steps}; nothing to train (raise train.max_steps to continue)"  # fmt: skip
    env = launch_environment(recipe.train.device)
    if args.dry_run:
        print(dump_recipe(recipe), end="")
        if not start.finished:
            print(f"# {start.describe()}")
        print("# " + (finished if start.finished else shown_launch(args, env, recipe.logging.verbose)))
        return 0
    if start.finished:
        print(f"ntl-pretrain: {finished}")
        return 0
    return launch(args, recipe, env)


def launch(args: argparse.Namespace, recipe: Recipe, env: dict[str, str]) -> int:
    """Run the launcher under the supervisor; the exit code of the run. Its lock goes with it, whatever ends it."""
    from ntl_pretrain.runtime import run_lock
    from ntl_pretrain.runtime.supervisor import EXIT_MARGIN_S, supervise

    line = launch_line(args, recipe)
    piped = is_pipe(args.recipe)  # the ranks cannot read the pipe again: they get its recipe, resolved, from a file
    if piped:
        args.recipe, args.overrides = str(_written_for_the_ranks(recipe)), []
    try:
        command = train_command(args, env, recipe.logging.verbose)  # refuses GPUs it cannot select, before the line
        print(f"ntl-pretrain: {line}", file=sys.stderr, flush=True)
        started = time.time()
        grace_seconds = recipe.train.stop_grace_seconds + EXIT_MARGIN_S
        log = Path(recipe.train.output_dir) / "logs" / "supervisor.log"  # its own lines, whatever the console does
        return supervise(command, env, grace_seconds, lambda code: end_line(recipe, code, started), log=log)
    finally:
        run_lock.clear_if_gone(recipe.train.output_dir)
        if piped:
            Path(args.recipe).unlink(missing_ok=True)


def _written_for_the_ranks(recipe: Recipe) -> Path:
    handle, name = tempfile.mkstemp(prefix="ntl-pretrain-piped-recipe-", suffix=".yaml")
    with os.fdopen(handle, "w") as file:
        file.write(dump_recipe(recipe))
    return Path(name)


def launch_line(args: argparse.Namespace, recipe: Recipe) -> str:
    """Said once the recipe passed every check: what the next half minute or more (the ranks import torch and
    DeepSpeed and build the model, silently) is spent on, and which recipe file it follows."""
    processes = f"{args.nproc} process" + ("es" if args.nproc > 1 else "")
    return (
        f"training {recipe_path(args.recipe)} into {recipe.train.output_dir}: starting {processes}; each "
        "loads the libraries and builds the model before step 1"
    )


def end_line(recipe: Recipe, code: int, started: float) -> str | None:
    """A run stopped by a signal, or failed inside, ends with one line of its own after the launcher's lines."""
    from pathlib import Path

    from ntl_pretrain.reporting.console import last_failure_line, stop_line
    from ntl_pretrain.runtime.stopping import EXIT_STOPPED

    output_dir = Path(recipe.train.output_dir)
    if code == EXIT_STOPPED:
        line = stop_line(output_dir, recipe.train.max_steps)
    else:
        line = last_failure_line(output_dir, started) if code else None
    return None if line is None else f"ntl-pretrain: {line} (exit code {code})"


def launch_environment(device: str) -> dict[str, str]:
    """The ranks' environment: DeepSpeed's CPU accelerator where they run on CPU (`train.device: cpu`, or `auto`
    without a visible GPU), with the GPUs hidden from them when the recipe chose cpu."""
    import torch

    env = dict(os.environ)
    if device == "cpu":
        env["DS_ACCELERATOR"], env["CUDA_VISIBLE_DEVICES"] = "cpu", ""
    elif not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def run_export(args: argparse.Namespace) -> int:
    """Its first line at once for a step folder (anything else is refused in one line), then the stage under way
    every few seconds (`ongoing`)."""
    check_output("out_dir", Path(args.out_dir), [args.checkpoint_dir], args.overwrite, folder=True)
    step_folder = (Path(args.checkpoint_dir) / "hf_config").is_dir()
    from ntl_pretrain.reporting.console import ongoing, stdout_to_stderr

    what = f"{args.checkpoint_dir} -> {args.out_dir}"
    with stdout_to_stderr(), ongoing(what, prefix="ntl-pretrain export: ", at_once=step_folder) as stage:
        stage("loading the libraries")  # stdout carries the folder only
        from ntl_pretrain.export.hf_folder import export_checkpoint
        from ntl_pretrain.reporting.console import no_library_progress_bars

        with no_library_progress_bars():
            folder = export_checkpoint(args.checkpoint_dir, args.out_dir, dtype=args.dtype, stage=stage)
    print(folder)
    return 0


def run_convert_gguf(args: argparse.Namespace) -> int:
    from ntl_pretrain.export.gguf_file import gguf_path
    from ntl_pretrain.reporting.console import ongoing, stdout_to_stderr

    gguf = [] if args.gguf.startswith("pkg:") else [args.gguf]
    check_output("out_dir", Path(args.out_dir), gguf, args.overwrite, folder=True)
    gguf_path(args.gguf)  # a missing or foreign file is refused in one line, before the conversion's first line
    what = f"{args.gguf} -> {args.out_dir}"
    with stdout_to_stderr(), ongoing(what, prefix="ntl-pretrain convert-gguf: ", at_once=True) as stage:
        stage("loading the libraries")  # stdout carries the folder only
        from ntl_pretrain.config.deepspeed import deepspeed_on_this_machine
        from ntl_pretrain.export.hf_folder import convert_gguf
        from ntl_pretrain.reporting.console import no_library_progress_bars

        # no bars, and no "Setting accelerator to CPU" from DeepSpeed (transformers imports it while saving)
        with no_library_progress_bars(), deepspeed_on_this_machine():
            folder = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype, stage=stage)
    print(folder)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """One line per checkpoint: intact, damaged (every bad file and what is wrong), unverifiable (saved before
    manifests) or not a checkpoint at all; one more for a `latest` pointer that is missing, empty or names no
    checkpoint. Exit code 1 when anything is wrong or there is no checkpoint; 2 (bad input) for a path that does
    not exist."""
    path = Path(args.path).expanduser()
    if not path.exists():
        raise InputError(f"{path}: does not exist; name a run directory, its checkpoints/ folder or a step folder")
    from ntl_pretrain.checkpoint import store as checkpoint

    folders = checkpoint.checkpoints_in(path)
    if not folders:
        print(f"ntl-pretrain verify: no checkpoint in {args.path}", file=sys.stderr)
        return 1
    wrong = [_verify_folder(folder, "size" if args.size_only else "checksum") for folder in folders]
    if folders != [path]:  # a run's checkpoints, not one step folder: its pointer too
        problem = checkpoint.pointer_problem(folders[0].parent)
        if problem is not None:
            print(f"{problem}: a resume takes {checkpoint.latest(folders[0].parent)} instead")
        wrong.append(problem is not None)
    return 1 if any(wrong) else 0


def _verify_folder(folder: Path, mode: str) -> bool:
    """Print the verdict on one step folder; True when something is wrong with it."""
    from ntl_pretrain.checkpoint import manifest
    from ntl_pretrain.checkpoint import store as checkpoint

    if not checkpoint.holds_checkpoint(folder):
        print(f"{folder}: not a checkpoint (no {manifest.MANIFEST}, no DeepSpeed model states); a resume ignores it")
        return True
    problems = manifest.verify(folder, mode)
    if problems is None:
        print(f"{folder}: unverifiable (no {manifest.MANIFEST}: saved before manifests existed)")
    elif problems:
        print(f"{folder}: damaged: " + "; ".join(str(problem) for problem in problems))
    else:
        print(f"{folder}: intact{_step_unlike_its_name(folder)}")
    universal = folder / manifest.UNIVERSAL
    if universal.is_dir() and (damage := manifest.universal_damage(universal, mode)) is not None:
        # derived from the shards: not the checkpoint's damage, but the next resume's conversion
        print(f"{universal}: {damage}; a resume on another number of ranks converts it again")
    return bool(problems)


def _step_unlike_its_name(folder: Path) -> str:
    """Where a checkpoint holds another step than its folder's name says (renamed, or a copy): the step a resume
    continues from (its manifest's; the name is only a label)."""
    from ntl_pretrain.checkpoint import store as checkpoint

    held = checkpoint.step_held(folder)
    named = checkpoint.step_of(folder) if checkpoint.STEP_DIR.match(folder.name) else None
    return "" if held is None or held == named else f" (holds step {held}, which a resume continues from)"


def package_version() -> str:
    """The installed distribution's version; a checkout run from PYTHONPATH (not installed) has none."""
    try:
        return importlib.metadata.version("ntl_pretrain")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a checkout)"


def build_parser(delegated: Iterable[str] = tuple(DELEGATED_COMMANDS)) -> argparse.ArgumentParser:
    """This module's commands plus the `delegated` ones (importing those takes seconds, so `main` asks only for
    the one that will run)."""
    every_command = ",".join((*OWN_COMMANDS, *DELEGATED_COMMANDS))
    parser = OneLineParser(prog="ntl-pretrain", description="Pretraining with CE + λ·NTL on DeepSpeed",
                           usage=f"%(prog)s [-h] [--version] [--verbose] {{{every_command}}} ...")  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, prog="ntl-pretrain")

    train = commands.add_parser("train", help="validate a recipe, then launch it with the deepspeed launcher")
    train.add_argument("recipe", help="the recipe file, or - to read it from stdin")
    train.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. loss.ntl.weight=0.5")
    train.add_argument("--nproc", type=int, default=None, help="processes (GPUs; CPU ranks without CUDA)")
    train.add_argument("--master-port", type=int, default=None, help="default: a free port")
    train.add_argument("--dry-run", action="store_true", help="print the resolved recipe and the command only")
    train.set_defaults(func=run_train)

    export = commands.add_parser("export", help="one checkpoint step folder -> HF folder (safetensors)")
    export.add_argument("checkpoint_dir", help="<output_dir>/checkpoints/step_<N>")
    export.add_argument("out_dir")
    export.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    export.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto = the run's training precision")  # fmt: skip
    export.set_defaults(func=run_export)

    convert = commands.add_parser("convert-gguf", help="GGUF causal LM -> HF folder usable as init_from")
    convert.add_argument("gguf", help="file path or pkg:<package>/<file>.gguf")
    convert.add_argument("out_dir")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    convert.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    convert.set_defaults(func=run_convert_gguf)

    verify = commands.add_parser("verify", help="check checkpoints against their manifests (intact / damaged)")
    verify.add_argument("path", help="a run directory, its checkpoints/ folder or one step_<N> folder")
    verify.add_argument("--size-only", action="store_true", help="compare sizes only (reads no file)")
    verify.set_defaults(func=run_verify)

    for name, command in DELEGATED_COMMANDS.items():
        if name not in delegated:  # listed by `--help`, never run: `main` registers the command it runs
            commands.add_parser(name, help=command.summary)
            continue
        importlib.import_module(command.arguments).register(commands, command.summary)
        if command.runs is not None:
            commands.choices[name].set_defaults(func=_imported_when_run(command.runs))
    add_verbose(parser)
    return parser


def _imported_when_run(runs: str) -> Callable[[argparse.Namespace], int | None]:
    module, function = runs.split(":")
    return lambda args: getattr(importlib.import_module(module), function)(args)


def _delegated_to_register(argv: list[str]) -> list[str]:
    """The delegated command named on the command line; none for `--help`, a typo or an own command."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    return [command] if command in DELEGATED_COMMANDS else []


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; run as the program (`argv` None), a command of ENDS_AT_ONCE ends the process."""
    keep_standard_streams_open()
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(_delegated_to_register(words))
    # Overrides may follow options (`train R --nproc 2 a.b=1`), which argparse cannot take as positionals.
    args, extra = parser.parse_known_args(words)
    command = " ".join(filter(None, (args.command, getattr(args, "data_command", None))))
    code = run_reporting(command, lambda: _run(args, extra), getattr(args, "verbose", False),
                         stop_signals=args.command not in DEFAULT_STOP)  # fmt: skip
    if argv is None and args.command in ENDS_AT_ONCE:
        _end_process(code)
    return code


def _end_process(code: int) -> None:
    """Exit now, with what was printed flushed: everything the command owns is on disk and its children are gone."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def module_main(command: str) -> int:
    """`python -m ntl_pretrain.<package> ARGS` is `ntl-pretrain <command> ARGS`: the entry point of each rank of a
    launch (`deepspeed --module ntl_pretrain.doctor`). Through `main`, the arguments are parsed before torch is
    imported, so `--help` and a mistyped flag answer at once on every rank."""
    from ntl_pretrain.reporting.console import whole_lines

    whole_lines()  # under `deepspeed`, ranks share the launcher's pipes
    return main([command, *sys.argv[1:]])


def _run(args: argparse.Namespace, extra: list[str]) -> int | None:
    if extra:
        if getattr(args, "overrides", None) is None or any(arg.startswith("-") for arg in extra):
            raise InputError(f"unrecognized arguments: {' '.join(extra)} (`--help` lists the arguments)")
        args.overrides = [*args.overrides, *extra]  # one without `=` is refused naming it, as any override
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
