"""What an ``hf`` DST needs besides weights for ``from_pretrained``: ``config.json`` and friends.

A training checkpoint holds weights, not the model's description, so ``--hf-config DIR``
names a directory holding ``config.json`` (the model's original directory, a hub
snapshot, a transformers ``Trainer`` checkpoint). Without the option, a ``config.json``
in SRC (a directory) is used, with a note. One beside SRC (in the directory SRC sits
in, which may be a shared download folder) is not: a note says how to name it.

Every file copied passes the source-file gate (``files.py``): a regular file inside the
config directory once symlinks are resolved (a hub snapshot's links into its
``blobs/`` included). A companion that is a link out of it, a FIFO or a dangling link
is refused, naming it, rather than left out of an export that would then lack it; a
config found in SRC is then not copied at all, with a note.

Copied: the files ``from_pretrained``, ``AutoTokenizer`` and ``AutoProcessor`` read that
are not weights (``COMPANIONS``), plus the ``*.py`` files ``config.json``'s ``auto_map``
names (a model with its own code). Not copied: weights, optimizer, scheduler, RNG and
trainer state, anything else.

Before anything is written, the output's tensor names are checked against the model
``config.json`` describes (built by ``transformers`` on the meta device, when it is
installed and knows the architecture): a weight the model has and DST lacks would be
left at random by ``from_pretrained``. That model is never built larger than DST could
match (``build_limit``): the counts the config claims are checked before transformers
reads it, and the build stops at the limit, so a config claiming 200,000 layers is
refused in seconds instead of building for hours.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardckpt.core.copies import copy_file
from shardckpt.core.errors import BadInputError, UsageError
from shardckpt.core.files import has_file, os_error, source_file, writing
from shardckpt.core.words import counted
from shardckpt.state.tree import TensorMeta

CONFIG_FILE = "config.json"

COMPANIONS = (
    CONFIG_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece*.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
"""File names (globs) copied from the config directory, when present."""


@dataclass(frozen=True)
class HfConfig:
    """A directory holding ``config.json``, the files to copy from it, and how it was found."""

    root: Path
    files: tuple[str, ...]
    """Plain file names inside ``root``, ``config.json`` first."""
    detected: bool
    """Whether it was found beside SRC rather than named by ``--hf-config``."""
    config: dict
    tied: Mapping[str, str] = field(default_factory=dict)
    """The weights DST leaves out, as ``save_pretrained`` does, each with the one it is tied to."""
    dtype: str | None = None
    """The dtype DST's ``config.json`` says (its weights'), where it differs from this one's."""
    made: bool = False
    """Whether ``config`` was made from SRC's own model arguments: written, not copied from ``root``."""


def read_config(path: Path) -> dict:
    """Return ``config.json`` parsed, or raise one line naming it."""
    try:
        config = json.loads(source_file(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise os_error(exc, path) from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise BadInputError(
            "is not a JSON object, so not a transformers model config",
            path=path,
            hint="copy config.json again from the model's directory or hub repository",
        )
    return config


def _auto_map_code(config: dict, root: Path) -> list[str]:
    """Return the ``*.py`` files in ``root`` that ``auto_map`` names (``module.Class``)."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict):
        return []
    refs: list[str] = []
    for value in auto_map.values():
        refs += value if isinstance(value, list) else [value]
    names = []
    for ref in refs:
        # "repo--module.Class" is code in another repository: not in root.
        if isinstance(ref, str) and "--" not in ref and "." in ref:
            name = ref.rsplit(".", 1)[0] + ".py"
            if "/" not in name and name not in names and has_file(root / name, root):
                names.append(name)
    return names


def hf_config(root: str | os.PathLike, *, detected: bool = False) -> HfConfig:
    """Return what to copy from ``root``; refuse a directory without ``config.json``, or a file that fails the gate."""
    root = Path(root)
    if root.is_file():
        raise UsageError(
            "--hf-config: is a file; the option takes the directory holding config.json",
            path=root,
            hint=f"pass --hf-config '{root.parent}'",
        )
    if not has_file(root / CONFIG_FILE, root):
        raise UsageError(
            f"--hf-config: no '{CONFIG_FILE}' in this directory",
            path=root,
            hint="pass the directory of the model's config.json (its original directory or "
            "a hub snapshot)",
        )
    config = read_config(root / CONFIG_FILE)
    files = [CONFIG_FILE]
    for entry in sorted(p.name for p in root.iterdir()):
        if entry != CONFIG_FILE and any(fnmatch.fnmatchcase(entry, g) for g in COMPANIONS):
            files.append(source_file(root / entry, root).name)
    files += [f for f in _auto_map_code(config, root) if f not in files]
    return HfConfig(root, tuple(files), detected, config)


def config_in(src: str | os.PathLike) -> Path | None:
    """Return SRC when it is a directory with something called ``config.json`` in it, else None.

    ``hf_config`` then reads it through the gate.
    """
    src = Path(src)
    return src if src.is_dir() and os.path.lexists(src / CONFIG_FILE) else None


def config_beside(src: str | os.PathLike) -> Path | None:
    """Return the directory SRC sits in when it holds ``config.json``: used only when named."""
    parent = Path(src).resolve().parent
    return parent if os.path.lexists(parent / CONFIG_FILE) else None


def copy_files(config: HfConfig, dst: Path) -> None:
    """Copy the config directory's files into ``dst`` (the staged output), each flushed to disk.

    ``config.json`` is written with its dtype changed when ``config.dtype`` says so
    (``with_dtype``), keys sorted and indented as ``save_pretrained`` writes it.
    """
    for name in config.files:
        if name == CONFIG_FILE and (config.dtype is not None or config.made):
            said = _retyped(config.config, config.dtype) if config.dtype else config.config
            text = json.dumps(said, indent=2, sort_keys=True)
            with writing(dst / name), open(dst / name, "w", encoding="utf-8") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
        else:
            copy_file(config.root / name, dst / name, config.root)


# The keys transformers keeps a model's dtype under: ``dtype`` (5.x), ``torch_dtype`` (4.x).
_DTYPE_KEYS = ("dtype", "torch_dtype")
_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16")


def _said_dtypes(config: dict) -> list[str]:
    """Return the dtypes ``config`` (its sub-configs too) names under ``_DTYPE_KEYS``."""
    out, todo = [], [config]
    while todo:
        node = todo.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                todo.append(value)
            elif key in _DTYPE_KEYS and value in _DTYPE_NAMES:
                out.append(value)
    return out


def _retyped(config: dict, dtype: str) -> dict:
    """Return ``config`` with every dtype it names (``_said_dtypes``) replaced by ``dtype``."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            value = _retyped(value, dtype)
        elif key in _DTYPE_KEYS and value in _DTYPE_NAMES:
            value = dtype
        out[key] = value
    return out


def weights_dtype(tensors: Mapping[str, object]) -> str | None:
    """Return the floating dtype holding most of ``tensors``' bytes, as config.json names it."""
    sizes: dict[str, int] = {}
    for meta in tensors.values():
        if isinstance(meta, TensorMeta) and meta.dtype.is_floating_point:
            name = str(meta.dtype).removeprefix("torch.")
            sizes[name] = sizes.get(name, 0) + meta.nbytes
    return max(sorted(sizes), key=sizes.__getitem__) if sizes else None


def with_dtype(
    config: HfConfig, tensors: Mapping[str, object], note: Callable[[str], None]
) -> HfConfig:
    """Return ``config`` to be written saying the dtype of DST's weights, with a note when it said another.

    ``from_pretrained`` loads weights in the dtype ``config.json`` names: a float32
    export under a config saying bfloat16 would load rounded, a bfloat16 one under
    float32 would load widened.
    """
    dtype = weights_dtype(tensors)
    said = sorted(set(_said_dtypes(config.config)) - {dtype})
    if dtype not in _DTYPE_NAMES or not said:
        return config
    note(
        f"'{config.root / CONFIG_FILE}' says dtype {', '.join(said)} but DST's weights are "
        f"{dtype}: writing {dtype} in DST's config.json, so from_pretrained loads them as written"
    )
    return replace(config, dtype=dtype)


def build_limit(tensors: int) -> int:
    """Return the most weights and buffers the model built to check DST's ``tensors`` may register.

    A model DST fits registers each of DST's tensors once, plus a few non-persistent
    buffers and tied duplicates; twice DST's count and a thousand more leaves room for
    those, and building that many meta tensors takes seconds. A model past it has
    weights DST lacks, whatever they are.
    """
    return 2 * tensors + 1000


class OutOfProportion(Exception):
    """``config.json`` describes a model far larger than DST: what it claims, as a phrase."""


# Keys whose integer is a count of layers: num_hidden_layers, n_layer, encoder_layers, ...
_LAYER_COUNT = re.compile(r"(^|_)layers?$")


def _check_claims(config: dict, limit: int, largest: int) -> None:
    """Refuse counts in ``config`` (sub-configs too) that transformers would loop over, out of proportion.

    A layer holds at least one weight, so a layer count over ``limit`` cannot fit DST;
    ``num_labels`` sizes a classifier whose weight holds at least that many elements,
    at most ``largest`` in DST. Checked before transformers reads the config, whose
    own code makes a list entry per layer and a dict entry per label.
    """
    todo = [config]
    while todo:
        node = todo.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                todo.append(value)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if _LAYER_COUNT.search(key) and value > limit:
                raise OutOfProportion(f"{key} is {value}")
            if key == "num_labels" and value > largest:
                raise OutOfProportion(
                    f"num_labels is {value}, more than the {largest} elements of DST's "
                    "largest tensor"
                )


@contextmanager
def _registering_at_most(limit: int, claim: str) -> Iterator[None]:
    """Within the block, raise ``OutOfProportion(claim)`` once modules register over ``limit`` tensors."""
    from torch.nn.modules import module

    count = 0

    def counting(*_args) -> None:
        nonlocal count
        count += 1
        if count > limit:
            raise OutOfProportion(claim)

    handles = [
        module.register_module_parameter_registration_hook(counting),
        module.register_module_buffer_registration_hook(counting),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class Expected:
    """The model ``config.json`` describes, as transformers builds it: its class, weights, ties."""

    model: str
    """The class built, as messages name it (``LlamaForCausalLM``, with the ``model_type`` it was chosen by)."""
    names: frozenset[str]
    """Its state dict's names."""
    tied: Mapping[str, str]
    """Each name ``save_pretrained`` leaves out, with the name of the weight it is tied to."""
    loaded_as: Mapping[str, str] = field(default_factory=dict)
    """Each of DST's names that ``from_pretrained`` loads under another name: its weight
    conversions (transformers 5 fuses a MoE layer's per-expert weights into one)."""

    def loaded(self, names: Collection[str]) -> set[str]:
        """Return the model's names ``from_pretrained`` fills from ``names``."""
        return {self.loaded_as.get(n, n) for n in names}


# The heads a config without ``architectures`` is tried as, in this order: a language
# model first (what most exports are), then the bare model and the other common heads.
_AUTO_HEADS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
)


def _model_classes(config: dict, transformers) -> tuple[list[tuple[str, type]], str]:
    """Return the transformers classes ``config`` may describe (named as messages say), or why none."""

    def model_class(name: object) -> type | None:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        ok = isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
        return cls if ok else None

    archs = config.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
            return [], f"its 'architectures' is {json.dumps(archs)}, not one class name"
        # Only a model class of transformers' own is built: the name comes from a file.
        cls = model_class(archs[0])
        if cls is None:
            return [], f"transformers has no model class '{archs[0]}'"
        return [(archs[0], cls)], ""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return [], "it names neither 'architectures' nor 'model_type'"
    from transformers.models.auto import modeling_auto

    found: list[tuple[str, type]] = []
    for mapping in _AUTO_HEADS:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        cls = model_class(name)
        if cls is not None and all(cls is not c for _, c in found):
            found.append((f"{name} (model_type '{model_type}')", cls))
    if not found:
        return (
            [],
            f"it names no 'architectures', and transformers knows no model_type '{model_type}'",
        )
    return found, ""


def expected_names(
    config: HfConfig, limit: int, largest: int, names: Collection[str] = ()
) -> Expected | str:
    """Return the model ``config`` describes (``Expected``), or why that cannot be told cheaply.

    Cannot be told: ``transformers`` is not installed, or does not know the model (a
    model with its own code is never imported here). A config without ``architectures``
    (what ``LlamaConfig(...).save_pretrained`` writes) is built as each head its
    ``model_type`` has in transformers' auto classes, and the one ``names`` fits best is
    taken. ``OutOfProportion`` when the model would register more than ``limit``
    tensors, or the config claims counts out of proportion (``_check_claims``).
    """
    try:
        import torch
        import transformers
    except ImportError:
        return "transformers is not installed"
    if config.config.get("auto_map"):
        return "its model has its own code (auto_map), which shardckpt does not run"
    classes, why = _model_classes(config.config, transformers)
    if not classes:
        return why
    _check_claims(config.config, limit, largest)
    built: list[Expected] = []
    for name, cls in classes:
        try:
            if config.made:  # no file to read: the dict made from SRC's model arguments
                made = dict(config.config)
                conf = transformers.AutoConfig.for_model(made.pop("model_type"), **made)
            else:
                conf = transformers.AutoConfig.from_pretrained(config.root, trust_remote_code=False)
            claim = f"the {name.split()[0]} model it describes has more weights than DST"
            with torch.device("meta"), _registering_at_most(limit, claim):
                model = cls(conf)
        except OutOfProportion:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means "cannot tell cheaply"
            why = f"transformers could not build its {name} ({type(exc).__name__})"
            continue
        tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
        state = model.state_dict()
        built.append(Expected(name, frozenset(state), tied, _loaded_as(model, names)))
    if not built:
        return why
    # The head ``names`` fits best: fewest weights DST would lack, then fewest extra.
    return min(
        built,
        key=lambda e: (
            len(e.names - e.loaded(names) - set(e.tied)),
            len(e.loaded(names) - e.names),
        ),
    )


def _loaded_as(model, names: Collection[str]) -> dict[str, str]:
    """Return the names of ``names`` that ``from_pretrained`` of ``model`` loads under another, with that name.

    transformers' own renaming (``core_model_loading.rename_source_key`` with the model's
    ``get_model_conversion_mapping``), as its loader applies it; none where this
    transformers has no weight conversions.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:
        return {}
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    out = {}
    for name in names:
        # Without the base model's prefix: DST names the weights as the model itself does.
        renamed, _ = rename_source_key(name, renamings, converters)
        if renamed != name:
            out[name] = renamed
    return out


def check_names(
    config: HfConfig, tensors: Mapping[str, object], note: Callable[[str], None]
) -> HfConfig | None:
    """Return ``config`` with the ties DST leaves out, when DST's ``tensors`` (name to metadata) load into its model.

    None when a detected config is left out. An explicit ``--hf-config`` whose model
    lacks a weight DST holds, or has one DST lacks, is refused (one line, the first name
    and the count); a detected one is only left out, with a ``note``. Unexpected names
    alone are a note: ``from_pretrained`` ignores them. A config out of proportion with
    DST (``build_limit``) is refused before its model is built (exit 3), or, detected,
    left out with a note. A model that cannot be built says so in a note: the check
    did not run.
    """
    names = set(tensors)
    limit = build_limit(len(names))
    largest = max((t.numel for t in tensors.values() if isinstance(t, TensorMeta)), default=0)
    where = config.root / CONFIG_FILE
    try:
        expected = expected_names(config, limit, largest, names)
    except OutOfProportion as exc:
        what = (
            f"{exc}: a model that large is not built to check DST's "
            f"{counted(len(names), 'tensor')} (at most {limit} weights)"
        )
        if config.detected:
            note(f"'{where}': {what}: not copying it (pass --hf-config DIR)")
            return None
        raise BadInputError(
            what,
            path=where,
            hint="pass --hf-config the directory of the model these weights belong to",
        ) from None
    if isinstance(expected, str):
        note(
            f"'{where}': not checking DST's weight names against the model it describes: {expected}"
        )
        return config
    loaded = expected.loaded(names)
    missing = sorted(expected.names - loaded - set(expected.tied))
    unexpected = sorted(n for n in names if expected.loaded_as.get(n, n) not in expected.names)
    if missing:
        first = missing[0]
        hint = _rename_hint(missing, unexpected)
        what = (
            f"the {expected.model} model of '{where}' has "
            f"{counted(len(missing), 'weight')} DST would lack, e.g. '{first}'"
        )
        if config.detected:
            note(f"{what}: not copying it ({hint}, or pass --hf-config DIR)")
            return None
        raise UsageError(f"--hf-config: {what}", path=config.root, hint=hint)
    if unexpected:
        note(
            f"{counted(len(unexpected), 'tensor')} of DST not among the weights of the model "
            f"in '{where}', e.g. '{unexpected[0]}': from_pretrained will ignore them"
        )
    return replace(config, tied=tied_in(expected.tied, tensors))


def tied_in(tied: Mapping[str, str], tensors: Mapping[str, object]) -> dict[str, str]:
    """Return the ties of ``tied`` (name to the weight it is tied to) whose both ends ``tensors`` holds alike."""
    out = {}
    for name, source in sorted(tied.items()):
        a, b = tensors.get(name), tensors.get(source)
        if isinstance(a, TensorMeta) and isinstance(b, TensorMeta):
            if (a.shape, a.dtype) == (b.shape, b.dtype):
                out[name] = source
    return out


def _rename_hint(missing: list[str], unexpected: list[str]) -> str:
    """Return how to make the names DST lacks: the prefix ``--rename`` that fits the most of them."""
    lacking, extra = set(missing), set(unexpected)
    counts: dict[str, int] = {}
    for name in unexpected:
        # DST's name is a model name with a prefix cut off (add it), or with one more (strip it).
        for i, ch in enumerate(name):
            if ch == "." and name[i + 1 :] in lacking:
                hint = f"strip the prefix with --rename '^{re.escape(name[: i + 1])}='"
                counts[hint] = counts.get(hint, 0) + 1
    for name in missing:
        for i, ch in enumerate(name):
            if ch == "." and name[i + 1 :] in extra:
                hint = f"add the prefix with --rename '^={name[: i + 1]}'"
                counts[hint] = counts.get(hint, 0) + 1
    if not counts:
        return "check that these weights belong to that model, or --rename them to its names"
    return max(sorted(counts), key=counts.__getitem__)
