"""The model a check runs: its config read from a family name, a config, a checkpoint directory or a hub id (one
loader, :func:`load_config`), built by one builder (:func:`causal_lm_builder`) with random weights and, by default,
one decoder layer of each kind the config has (:func:`reduced_config`). ``python -m compilepack check`` and
:func:`build_model` both build through these. :func:`stock_path` says which code stock transformers runs for a
model's mixers (kernel or torch fallback): the baseline a packed run is compared with."""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import CompilepackError, UnsupportedModelError
from ..patching.builder import function_behind
from .results import describe_error


class ConfigError(CompilepackError, ValueError):
    """A model's config cannot be read: the message names the file, what is wrong with it and the fix."""


# ------------------------------------------------------------------------------------------------------ the config


def load_config(model, trust_remote_code: bool = False) -> tuple[object, str | None]:
    """``(config, source)``: the config of a compilepack family name (its benchmark config: hidden 256, one layer
    per mixer kind), of a ``transformers`` config (itself), of a checkpoint directory or its ``config.json``
    (source: the directory, where ``from_pretrained`` finds the weights), or of a hub id (read only when the hub
    is reachable; source: the id). ``source`` is None when there are no weights to load.

    Code from a checkpoint (``auto_map``) runs only with ``trust_remote_code``. Raises :class:`ConfigError`,
    naming the file and the fix, when the config is not JSON, has no ``model_type``, names a model type this
    transformers does not know, or cannot be read.

    >>> config, source = load_config(name)  # doctest: +SKIP
    """
    if not isinstance(model, (str, os.PathLike)) and hasattr(model, "model_type"):
        return model, None
    from ..patching import family_named, supported_model_types

    if isinstance(model, str) and model in supported_model_types():
        return family_named(model).bench_config(), None
    path = Path(model)
    if not path.exists():
        return _from_hub(str(model), trust_remote_code), str(model)
    config_path = path / "config.json" if path.is_dir() else path
    _check_declared(config_path, trust_remote_code)
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (ValueError, OSError, TypeError, KeyError) as error:
        raise ConfigError(f"{config_path}: transformers cannot read this config ({describe_error(error)}). Fix what "
                          "it names, or write the file again with config.save_pretrained(directory).") from error
    return config, str(config_path.parent)


def _check_declared(config_path: Path, trust_remote_code: bool) -> None:
    """Read ``config.json`` before transformers does, to say precisely what is wrong with it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not config_path.is_file():
        raise ConfigError(f"{config_path} does not exist: point MODEL at a checkpoint directory holding "
                          "config.json, or at the config file itself.")
    try:
        declared = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{config_path} is not valid JSON ({error}). Fix the file, or write it again with "
                          "config.save_pretrained(directory).") from error
    declared = declared if isinstance(declared, dict) else {}
    model_type = declared.get("model_type")
    if model_type in CONFIG_MAPPING:
        return
    if declared.get("auto_map"):
        if trust_remote_code:
            return
        raise ConfigError(
            f"{config_path} declares its own code (auto_map: {sorted(declared['auto_map'])}) for model_type "
            f"{model_type!r}, which transformers does not ship. Running it means running that repository's Python: "
            "read it, then pass --trust-remote-code (trust_remote_code=True from Python).")
    if not model_type:
        raise ConfigError(
            f"{config_path} has no \"model_type\": transformers cannot tell which architecture to build. Add the "
            "field with the type the checkpoint was saved with (its model card or modeling code names it), or write "
            "the file again with config.save_pretrained(directory).")
    import transformers

    raise ConfigError(
        f"{config_path} has model_type {model_type!r}, which transformers {transformers.__version__} does not know, "
        "and the file declares no code of its own (auto_map). Correct the model_type if it is misspelled, or "
        "upgrade transformers if the architecture is newer than this release.")


def _from_hub(name: str, trust_remote_code: bool):
    import transformers

    from ..patching import supported_model_types

    try:
        return transformers.AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - anything from the hub client: say what MODEL can be
        raise ConfigError(
            f"cannot read {name!r}: not a compilepack family ({', '.join(supported_model_types())}), not a local "
            f"checkpoint directory or config.json, and not readable from the hub ({describe_error(error, 200)}). "
            "Point it at a directory holding config.json."
        ) from error


# ------------------------------------------------------------------------------------------------------- the model


def causal_lm_builder(trust_remote_code: bool = False) -> Callable:
    """``build(config)``: the config's causal-LM model (``AutoModelForCausalLM``, else ``AutoModelForImageTextToText``
    for multimodal configs) with random weights; raises :class:`compilepack.UnsupportedModelError` when
    transformers has neither."""
    import transformers

    def build(config):
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
            with contextlib.suppress(ValueError):
                return auto.from_config(config, trust_remote_code=trust_remote_code)
        raise UnsupportedModelError(f"transformers has no causal-LM class for config {type(config).__name__}.")

    return build


def build_model(model, *, layers: int | str | None = "per_kind", seed: int = 0, patch: bool = True) -> torch.nn.Module:
    """A randomly initialised fp32 model in eval mode, patched unless ``patch=False``: the model factory.

    ``model`` is a compilepack family name (its benchmark config: hidden 256, one layer per mixer kind), a
    ``transformers`` config, or a path to a checkpoint directory or its ``config.json`` (only the config is read:
    :func:`load_config`). ``layers``: ``"per_kind"`` (default) keeps one layer of each kind the config has, an
    int the first N layers, None every layer.

    >>> model = build_model(name)  # doctest: +SKIP
    """
    from ..patching import patch as patched_model

    config, _ = load_config(model)
    if layers == "per_kind":
        config = reduced_config(config)
    elif layers is not None:
        config = reduced_config(config, int(layers))
    torch.manual_seed(seed)
    built = causal_lm_builder()(config).float().eval()
    return patched_model(built) if patch else built


# ------------------------------------------------------------------------------------------------------ the layers


def layer_kinds(model: torch.nn.Module) -> list[tuple]:
    """One signature per decoder layer: its submodules' classes and parameter shapes (two layers of one kind
    have the same signature)."""
    layers = _decoder_layers(model)
    return [
        tuple((name, type(module).__name__) for name, module in layer.named_modules())
        + tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
        for layer in layers
    ]


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    count = model.config.get_text_config().num_hidden_layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no ModuleList of {count} layers (num_hidden_layers) was found.")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def reduced_config(config, layers: int | None = None, *, builder: Callable | None = None, prefix: bool = False):
    """A copy of ``config`` with fewer decoder layers: ``layers`` first layers, or by default one layer of each
    kind the full model has (kinds as :func:`layer_kinds` sees them on a meta-device build, which allocates
    nothing). Per-layer lists (``layer_types``, ``layers_block_type``, ``mlp_layer_types``...) are cut to the
    kept layers; when the config cannot say which layer is which kind that way (layer indices, periods), or with
    ``prefix=True`` (loading real weights by layer index), the shortest prefix holding every kind is kept.
    """
    builder = builder or causal_lm_builder()
    total = config.get_text_config().num_hidden_layers
    if layers is not None:
        return _with_layers(config, list(range(min(layers, total))))
    kinds = layer_kinds(_on_meta(builder, config))
    first = sorted({kind: index for index, kind in reversed(list(enumerate(kinds)))}.values())
    candidates = [] if prefix else [first]
    candidates.append(list(range(max(first) + 1)))
    for keep in candidates:
        reduced = _with_layers(config, keep)
        if set(layer_kinds(_on_meta(builder, reduced))) == set(kinds):
            return reduced
    return copy.deepcopy(config)


def _with_layers(config, keep: list[int]):
    config = copy.deepcopy(config)
    text = config.get_text_config()
    total = text.num_hidden_layers
    for name, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and len(value) == total and ("layer" in name or "block" in name):
            setattr(text, name, type(value)(value[i] for i in keep))
        elif isinstance(value, (list, tuple)) and name.endswith(("_indices", "_only_layers", "_layer_ids")):
            setattr(text, name, type(value)(keep.index(i) for i in value if i in keep))
    text.num_hidden_layers = len(keep)
    return config


def _on_meta(builder: Callable, config) -> torch.nn.Module:
    with torch.device("meta"):
        return builder(config)


# ------------------------------------------------------------------------------------------------ what stock runs


def stock_path(model: torch.nn.Module, device=None) -> str:
    """The code stock transformers runs for ``model``'s mixers, in words, e.g. ``"cpu; attention: sdpa;
    causal_conv1d_fn: torch fallback"``: the device (default: the model's), the attention implementation, then each
    kernel global of the model's modeling module (``use_kernel_func_from_hub_with_fallback``) with the package its
    wrapper found at import, or "torch fallback" (read from the wrapper's closure: what runs, not what is
    installed)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    parts = [device.type, f"attention: {model.config._attn_implementation}"]
    module = sys.modules.get(type(model).__module__)
    for name, function in sorted(vars(module).items() if module else ()):
        cells = _closure(function) or _closure(getattr(function, "__wrapped__", None))
        if "is_new_implementation" in cells:
            parts.append(f"{name}: {cells['package'] if cells['is_new_implementation'] else 'torch fallback'}")
    return "; ".join(parts)


def _closure(function) -> dict:
    """The closure cells of a transformers kernel function (``use_kernel_func_from_hub_with_fallback``'s wrapper)."""
    function = function_behind(function) or function
    return inspect.getclosurevars(function).nonlocals if inspect.isfunction(function) else {}
