"""What every command line of the package shares: checked values, one-line errors, defaults in ``--help``.

Every value is checked before any work starts: each while the command line is parsed, then the
values together (:func:`check_sizes`), then whether the sizes fit in this machine's GPU and host
memory (:func:`check_memory`), then whether the output files can be written (:func:`claim_output`).
A bad one ends the command with exactly one line on standard error, ``offload_examples <command>:
error: ...``, and exit code 2 (argparse's code for a usage error): no usage block, no traceback.
Results are written whole or not at all (:class:`OutputFile`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, NoReturn, Sequence

import torch

from offload_examples.features.planner.costs import available_host_bytes
from offload_examples.instruments.models import has_transformer_engine

__all__ = [
    "BYTE_UNITS", "DTYPES", "KINDS", "MARGIN_PERCENT", "RESERVE_BYTES", "SKIP_ENV", "ArgumentParser", "HelpFormatter",
    "Need", "OutputFile", "SizeError", "Stack", "add_device", "add_json", "bytes_arg", "check_kind", "check_memory",
    "check_sizes", "claim_output", "default_device", "device_arg", "dtype_bytes", "field_int_arg", "fractions_arg",
    "gpu_free_bytes", "host_available_bytes", "int_arg", "json_path_arg", "json_text", "memory_error",
    "nonnegative_int", "one_line", "output_folder_arg", "positive_int", "size_error_text", "write_atomic",
]

#: The dtypes a scenario's ``--dtype`` accepts.
DTYPES = ("float32", "bfloat16", "float16")
#: The transformer layers ``--kind`` chooses from (see :func:`offload_examples.instruments.models.layer_kind`).
KINDS = ("auto", "torch", "te")
#: Integer sizes that may be 0; every other integer field of a size dataclass must be at least 1.
MAY_BE_ZERO = frozenset({"warmup", "seed"})
#: Seeds go to ``torch.manual_seed`` and ``torch.Generator.manual_seed``.
MAX_SEED = 2**32 - 1
#: Shown where ``--kind te`` is asked for without Transformer Engine.
TE_MISSING = "--kind te needs Transformer Engine: pip install 'offload_examples[te]'"


def one_line(text: str) -> str:
    """``text`` with every character that would start a new line (or is otherwise unprintable) escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default: the text's own ``default`` where it says one,
    else the option's default value (``off`` for a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)".strip()
        if action.default is None:
            return text
        return f"{text} (default: %(default)s)".strip()


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line on standard error and exit code 2.

    ``command`` names the command in errors (``offload_examples basic``); ``--help`` shows
    ``python -m <command>`` as the program.
    """

    def __init__(self, command: str, description: str | None = None, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(prog=f"python -m {command}", description=description, **kwargs)
        self.command = command

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.command}: error: {one_line(message)}\n")


def int_arg(minimum: int, maximum: int | None = None):
    """An argparse ``type``: an integer of at least ``minimum`` (and at most ``maximum``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


#: An argparse ``type``: an integer of at least 1.
positive_int = int_arg(1)
#: An argparse ``type``: an integer of at least 0.
nonnegative_int = int_arg(0)


#: The units :func:`bytes_arg` accepts after a number, in bytes.
BYTE_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6,
              "GB": 10**9, "TB": 10**12}


def bytes_arg(text: str) -> int:
    """An argparse ``type``: a positive number of bytes, plain (``1048576``) or with a unit of
    :data:`BYTE_UNITS` (``40GiB``, ``1.5GB``, ``512 MiB``)."""
    number = text.strip().rstrip("".join({c for unit in BYTE_UNITS for c in unit})).strip()
    unit = text.strip()[len(number):].strip()
    try:
        value = float(number) * BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a number of bytes such as 1048576 or 40GiB "
                                         f"(units: {', '.join(u for u in BYTE_UNITS if u)}), got {text!r}") from None
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {text!r}")
    return int(value)


def field_int_arg(name: str):
    """The argparse ``type`` for the integer size field ``name`` (see :data:`MAY_BE_ZERO`)."""
    if name == "seed":
        return int_arg(0, MAX_SEED)
    return nonnegative_int if name in MAY_BE_ZERO else positive_int


def default_device() -> torch.device:
    """``cuda`` when CUDA is available, else ``cpu``: where a command runs without ``--device``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_arg(text: str) -> torch.device:
    """An argparse ``type``: ``cpu``, ``cuda`` or ``cuda:N``, where CUDA is available."""
    try:
        device = torch.device(text)
    except Exception:  # torch raises RuntimeError for most bad strings, other types for some
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here ({why}); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: only {torch.cuda.device_count()} GPU(s) visible")
    return device


def fractions_arg(text: str) -> list[float]:
    """An argparse ``type``: comma-separated numbers between 0 and 1, e.g. ``0,0.5,1``."""
    fractions = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 0,0.5,1, got {text!r}") from None
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise argparse.ArgumentTypeError(f"every fraction must be between 0 and 1, got {part.strip()!r}")
        fractions.append(value)
    return fractions


def add_device(parser: argparse.ArgumentParser) -> None:
    """Add ``--device`` (checked by :func:`device_arg`; :func:`default_device` when not given)."""
    parser.add_argument("--device", type=device_arg, metavar="{cpu,cuda,cuda:N}",
                        help="where to run (default: cuda when available, else cpu)")


def add_json(parser: argparse.ArgumentParser) -> None:
    """Add ``--json PATH``: also write the report as JSON (checked by :func:`json_path_arg`)."""
    parser.add_argument("--json", metavar="PATH", type=json_path_arg,
                        help="also write the report as JSON to PATH, in a folder that exists (default: no JSON)")


def _check_path_text(text: str) -> Path:
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} contains a NUL character")
    return Path(text)


def json_path_arg(text: str) -> Path:
    """An argparse ``type``: a file to write JSON to, in a folder that exists and is writable.

    Nothing is created: a missing folder is an error, so a typo does not scatter folders about.
    """
    path = _check_path_text(text)
    try:
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; name a file in it, e.g. {path / 'report.json'}")
        folder = path.parent
        if not folder.exists():
            raise argparse.ArgumentTypeError(f"folder {folder} does not exist (create it first)")
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{folder} is not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"folder {folder} is not writable")
        if path.exists() and not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text} exists and is not writable")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror or e}") from None
    return path


def json_file_arg(text: str) -> Path:
    """An argparse ``type``: a JSON file to read, which must exist and hold a JSON object (a report)."""
    path = _check_path_text(text)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested beyond Python's limit
        raise argparse.ArgumentTypeError(f"{text} does not hold JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{text} holds JSON, but not an object (a report)")
    return path


def output_folder_arg(text: str) -> Path:
    """An argparse ``type``: a folder for output files; it is created when the results are written,
    so its nearest existing ancestor must be a writable folder."""
    path = _check_path_text(text)
    try:
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.exists():
            existing = Path.cwd()
        if not existing.is_dir():
            raise argparse.ArgumentTypeError(f"{existing} is a file, not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"folder {existing} is not writable")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {e.strerror or e}") from None
    return path


class SizeError(ValueError):
    """A size that cannot run, with the values that make it so.

    ``values`` maps each field the message is about to its value, so that a command line can say
    which of them the user did not type (:func:`size_error_text`).
    """

    def __init__(self, message: str, **values: Any):
        super().__init__(message)
        self.values = values


def size_error_text(error: ValueError, given: Collection[str]) -> str:
    """``error``'s message, saying which of the values it is about are defaults rather than typed.

    ``given``: the fields the command line set. ``basic --layers 3`` on a GPU, where ``offload`` is 3
    by default, reads ``offload must be between 1 and layers - 1 = 2, got 3 (--offload 3 is the default
    here, not a value you gave)``.
    """
    defaults = {k: v for k, v in getattr(error, "values", {}).items() if k not in given}
    if not defaults:
        return str(error)
    shown = ", ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
                      for k, v in defaults.items())
    verb = "is the default" if len(defaults) == 1 else "are the defaults"
    return f"{error} ({shown} {verb} here, not a value you gave)"


def check_sizes(config: Any, offload_of: str | None = "layers") -> None:
    """Raise :class:`SizeError` for a size dataclass whose values cannot run.

    Integer fields must be at least 1 (:data:`MAY_BE_ZERO` at least 0); ``dtype`` and ``kind`` must
    be among :data:`DTYPES` and :data:`KINDS`; ``offload`` must be between 1 and ``offload_of - 1``
    (so ``offload_of`` at least 2); ``hidden`` must be divisible by ``heads``.
    """
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        least = 0 if name in MAY_BE_ZERO else 1
        if value < least:
            raise SizeError(f"{name} must be at least {least}, got {value}", **{name: value})
        if name == "seed" and value > MAX_SEED:
            raise SizeError(f"seed must be at most {MAX_SEED}, got {value}", seed=value)
    if "dtype" in values and values["dtype"] not in DTYPES:
        raise SizeError(f"dtype must be one of {', '.join(DTYPES)}, got {values['dtype']!r}", dtype=values["dtype"])
    if "kind" in values and values["kind"] not in KINDS:
        raise SizeError(f"kind must be one of {', '.join(KINDS)}, got {values['kind']!r}", kind=values["kind"])
    if "offload" in values and offload_of is not None:
        n, k = values[offload_of], values["offload"]
        if n < 2:  # whatever offload is: it must be at least 1 and below n
            raise SizeError(f"{offload_of} must be at least 2 (offload is between 1 and {offload_of} - 1), got {n}",
                            **{offload_of: n})
        if not 1 <= k <= n - 1:
            raise SizeError(f"offload must be between 1 and {offload_of} - 1 = {n - 1}, got {k}",
                            **{"offload": k, offload_of: n})
    if "hidden" in values and "heads" in values and values["hidden"] % values["heads"]:
        raise SizeError(f"hidden ({values['hidden']}) must be divisible by heads ({values['heads']})",
                        hidden=values["hidden"], heads=values["heads"])


def check_kind(kind: str, device: torch.device) -> str | None:
    """Why layers of ``kind`` cannot be built for ``device``, or ``None`` when they can."""
    if kind != "te":
        return None
    if not has_transformer_engine():
        return TE_MISSING
    if device.type != "cuda":
        return "--kind te needs CUDA: Transformer Engine's layers run on a GPU"
    return None


# ---------------------------------------------------------------------------------------------------
# Whether a run fits: the GPU and host memory its sizes need, estimated before anything is allocated.
#
# Every command estimates what its sizes need (Need, built from Stack) and asks memory_error whether
# that fits here: on a GPU, the free memory torch.cuda.mem_get_info reports; on the host, MemAvailable
# from /proc/meminfo. The estimates count what the scenarios hold at their peak: parameters and their
# gradients (and optimizer state), the bytes each layer saves for backward (measured on PyTorch's
# layers: 9 h + 2 ffn elements per token for a transformer layer, 9 w for Linear(w, 4w), GELU,
# Linear(4w, w)), inputs, pinned host buffers and the host copies the gradient checks keep. They come
# within about 10 % of what a CPU run holds; MARGIN_PERCENT and RESERVE_BYTES leave room for what they
# do not count (allocator rounding, workspaces, the CUDA context).

GiB = 2**30
#: The estimate plus this percentage of it must fit in what is available.
MARGIN_PERCENT = 10
#: Bytes kept free on top: per process on the host, per GPU on a device.
RESERVE_BYTES = GiB // 2
#: Set to 1 to run even where the estimate says the sizes do not fit.
SKIP_ENV = "OFFLOAD_EXAMPLES_SKIP_MEMORY_CHECK"


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as in ``--dtype`` (``float32``, ``bfloat16``, ``float16``)."""
    return getattr(torch, dtype).itemsize


@dataclass(frozen=True)
class Stack:
    """``layers`` equal layers trained on ``tokens`` tokens of width ``width``.

    Attributes
    ----------
    params:
        Parameters of one layer.
    saved:
        Elements one layer saves for backward, per token.
    element:
        Bytes per element (the model's dtype).
    """

    layers: int
    params: int
    saved: int
    tokens: int
    width: int
    element: int

    @classmethod
    def transformer(cls, layers: int, hidden: int, heads: int, ffn: int, sequences: int, seq: int, dtype: str,
                    device_type: str) -> Stack:
        """``nn.Linear(hidden, hidden)`` and a pre-norm transformer layer per layer (the scenarios' model),
        on ``sequences`` sequences of ``seq`` tokens.

        On a CPU the gradient checks' deterministic kernels run attention's math kernel, which also saves
        the attention weights (``heads * seq`` elements per token) and two more tensors of the width.
        """
        params = 5 * hidden * hidden + 2 * hidden * ffn + 10 * hidden + ffn
        saved = 9 * hidden + 2 * ffn + 2 * heads + 4 + (0 if device_type == "cuda" else 2 * hidden + heads * seq)
        return cls(layers, params, saved, sequences * seq, hidden, dtype_bytes(dtype))

    @classmethod
    def linear(cls, layers: int, width: int, tokens: int, dtype: str) -> Stack:
        """``Linear(width, 4 width), GELU, Linear(4 width, width)`` per layer."""
        return cls(layers, 8 * width * width + 5 * width, 9 * width, tokens, width, dtype_bytes(dtype))

    @property
    def param_bytes(self) -> int:
        """Every layer's parameters."""
        return self.layers * self.params * self.element

    @property
    def build_bytes(self) -> int:
        """The parameters in float32 on the host, where the models are built before they move."""
        return self.layers * self.params * 4

    @property
    def io_bytes(self) -> int:
        """One tensor of the tokens' width: an input, its gradient, an output."""
        return self.tokens * self.width * self.element

    def saved_bytes(self, layers: int | None = None) -> int:
        """What ``layers`` layers (default: all) save for backward."""
        return (self.layers if layers is None else layers) * self.saved * self.tokens * self.element

    def step_bytes(self, states: int = 0) -> int:
        """A training step's peak without offloading: parameters, gradients and ``states`` optimizer
        tensors per parameter, every layer's saved activations and one layer's worth of backward
        temporaries, and the input, its gradient and the output."""
        return (2 + states) * self.param_bytes + self.saved_bytes(self.layers + 1) + 3 * self.io_bytes

    def copies_bytes(self, count: int) -> int:
        """``count`` host copies of the gradients (parameters', input's) and the output, as the checks keep."""
        return count * (self.param_bytes + 2 * self.io_bytes)


@dataclass(frozen=True)
class Need:
    """What a run needs: ``device`` bytes on each GPU it uses (one per rank), ``host`` bytes of host
    memory per rank; on a CPU run both are host memory. ``ranks``: processes, one per GPU."""

    device: int
    host: int
    ranks: int = 1

    def per_rank(self, ranks: int) -> Need:
        """The same per process, on ``ranks`` processes."""
        return dataclasses.replace(self, ranks=ranks)


def host_available_bytes() -> int:
    """What the host can allocate without swapping (the planner's
    :func:`~offload_examples.features.planner.costs.available_host_bytes`)."""
    return available_host_bytes()


def gpu_free_bytes(device: torch.device, here: bool = True) -> int:
    """Free memory of ``device``: ``torch.cuda.mem_get_info`` when this process runs there (``here``),
    else its total less :data:`RESERVE_BYTES` for the other process's CUDA context (asking for the free
    memory would start a context here too, which would hold memory on that GPU while the ranks run)."""
    if here:
        return torch.cuda.mem_get_info(device)[0]
    return torch.cuda.get_device_properties(device).total_memory - RESERVE_BYTES


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n < 2**80 else "over 10^15 GiB"  # sizes typed as huge integers stay exact


def _with_margin(n: int) -> int:
    return n + n * MARGIN_PERCENT // 100 + RESERVE_BYTES


def memory_error(need: Need, devices: Sequence[torch.device] = (), here: bool = True) -> str | None:
    """Why ``need`` does not fit, in one line, or ``None`` when it does.

    ``devices``: the GPUs the ranks use (none for a CPU run, whose device bytes are host bytes too);
    ``here``: whether this process runs on them (see :func:`gpu_free_bytes`). Set :data:`SKIP_ENV`
    to 1 to skip the check.
    """
    if os.environ.get(SKIP_ENV) == "1":
        return None
    gpus = [d for d in devices if d.type == "cuda"]
    for device in gpus:
        free = gpu_free_bytes(device, here)
        if _with_margin(need.device) > free:
            each = " on each of its GPUs" if need.ranks > 1 else ""
            return (f"the sizes need about {_gib(need.device)} of GPU memory{each} (estimated, plus a "
                    f"{MARGIN_PERCENT}% margin); {device} has {_gib(free)} free")
    per_rank = need.host + (0 if gpus else need.device)
    available = host_available_bytes()
    if available is not None and need.ranks * _with_margin(per_rank) > available:
        ranks = f" on {need.ranks} ranks" if need.ranks > 1 else ""
        return (f"the sizes need about {_gib(need.ranks * per_rank)} of host memory{ranks} (estimated, plus a "
                f"{MARGIN_PERCENT}% margin); {_gib(available)} is available (MemAvailable)")
    return None


def check_memory(parser: ArgumentParser, need: Need, devices: Sequence[torch.device] = (), here: bool = True,
                 hint: str = "") -> None:
    """End the command in one line when ``need`` does not fit (:func:`memory_error`);
    ``hint`` says what to change."""
    if (why := memory_error(need, devices, here)) is not None:
        parser.error(f"{why}: {hint or 'choose smaller sizes'} (or set {SKIP_ENV}=1 to run anyway)")


# ---------------------------------------------------------------------------------------------------
# Output files: proven writable before the run, written whole after it.


def json_text(data: Any) -> str:
    """``data`` as the commands write JSON: indented, with a final newline."""
    return json.dumps(data, indent=2) + "\n"


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a new file in the same folder renamed over it: a reader (or a
    run that fails while writing) sees the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    _fill(fd, tmp, text, path)
    return path


def _fill(fd: int, tmp: str, text: str, path: Path) -> None:
    """Write ``text`` into the open temporary file ``fd`` (at ``tmp``) and rename it to ``path``; remove it
    on failure."""
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class OutputFile:
    """A file a command writes after its run, proven writable before the run starts.

    :meth:`claim` makes the missing folders and creates the temporary file the results will be
    written to, so a folder that only looks writable (``/proc`` as root, a read-only mount) fails
    at once. :meth:`write` fills it and renames it over ``path`` (see :func:`write_atomic`); it may
    be called again with newer results. :meth:`close` removes what the claim created if nothing was
    written: the temporary file and the folders it made.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.made = list[Path]()  # folders made for it, deepest first
        self.written = False
        self._fd: int | None = None
        self._tmp = ""

    @classmethod
    def claim(cls, path: str | os.PathLike[str]) -> OutputFile:
        """Make ``path``'s missing folders and a temporary file beside it; ``OSError`` where that fails."""
        out = cls(path)
        missing = [p for p in [out.path.parent, *out.path.parent.parents] if not p.exists()]
        try:
            for folder in reversed(missing):
                with contextlib.suppress(FileExistsError):  # made meanwhile by another process: not ours
                    folder.mkdir()
                    out.made.insert(0, folder)
            out._fd, out._tmp = tempfile.mkstemp(dir=out.path.parent, prefix=f".{out.path.name}.", suffix=".tmp")
        except BaseException:
            out.close()
            raise
        return out

    def write(self, text: str) -> Path:
        """Replace ``path``'s content with ``text`` at once."""
        if self._fd is None:
            write_atomic(self.path, text)
        else:
            fd, self._fd = self._fd, None
            _fill(fd, self._tmp, text, self.path)
        self.written = True
        return self.path

    def write_json(self, data: Any) -> Path:
        """Replace ``path``'s content with ``data`` as indented JSON (:func:`json_text`) at once."""
        return self.write(json_text(data))

    def close(self) -> None:
        """Remove the unused temporary file, and the folders made for it if nothing was written."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            Path(self._tmp).unlink(missing_ok=True)
        if not self.written:
            for folder in self.made:
                with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                    folder.rmdir()

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def claim_output(parser: ArgumentParser, option: str, path: Path | None) -> OutputFile | None:
    """``path``'s :class:`~offload_examples.instruments.cli.OutputFile`, claimed before the run (``None``
    without a path); a path that cannot be written ends the command in one line naming ``option``."""
    if path is None:
        return None
    try:
        return OutputFile.claim(path)
    except OSError as e:
        parser.error(f"argument {option}: cannot write {str(path)!r}: {e.strerror or e}")
