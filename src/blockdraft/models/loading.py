"""Local folder / hub id / packaged asset -> (Target, tokenizer) and drafter folder -> DFlashDrafter.

Every mismatch between a drafter and its target that would silently wreck acceptance (hidden size, vocabulary,
mask id, taps) is refused here with the field at fault and the fix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from blockdraft.config import DraftConfig, load_draft_config
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target

# transformers 5 builds an empty tokenizer from the model type when a folder has none: look for real files.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MASK_EMBEDDING_FILE = "mask_embedding.pt"


def resolve_device(device: str | None) -> torch.device:
    """`None` picks CUDA when present; asking for CUDA without one is an error, not a silent fallback."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BlockdraftError(f"--device {device} was asked for but no CUDA GPU is visible; use --device cpu")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise BlockdraftError(f"--device {device!r} is not supported; use cpu or cuda")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """Default: float32 on CPU, bfloat16 on GPU."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise BlockdraftError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _target_location(name: str) -> str:
    """A local folder, the embedded asset name, or a hub id (left for transformers to fetch)."""
    from blockdraft.assets import resolve_target_path

    return str(resolve_target_path(name))


def load_target(name: str, device: torch.device, dtype: torch.dtype) -> tuple[Target, object | None]:
    """Load an HF causal LM (HF's own forward: `fast.engines.make_target` picks the engine) and its tokenizer (None
    when the folder has none: --prompt-ids still works)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location = _target_location(name)
    path = Path(location)
    if (location.startswith((".", "/", "~")) or path.exists()) and not (path / "config.json").exists():
        raise BlockdraftError(f"--target {name}: no config.json in {path}; pass a Hugging Face model folder or hub id")
    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype)
    except OSError as exc:
        raise BlockdraftError(f"--target {name} could not be loaded ({str(exc).splitlines()[0]}); pass a local model folder") from None
    model.to(device)
    tokenizer = None
    local = path.is_dir()
    if not local or any((path / f).exists() for f in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(location)
        except (OSError, ValueError, TypeError):
            tokenizer = None
    return Target(model), tokenizer


def check_pair(cfg: DraftConfig, target: Target, source: str) -> None:
    """Refuse a drafter that cannot work with this target."""
    if cfg.hidden_size != target.hidden_size:
        raise BlockdraftError(
            f"{source}: drafter hidden_size={cfg.hidden_size} but the target's is {target.hidden_size}; "
            "this drafter was trained for another target"
        )
    if cfg.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise BlockdraftError(
            f"{source}: drafter vocab_size={cfg.vocab_size} but the target's LM head has {target.vocab_size} rows; "
            "use the drafter trained for this target's tokenizer"
        )
    if cfg.mask_token_id >= target.vocab_size:
        raise BlockdraftError(
            f"{source}: {cfg.field_name('mask_token_id')}={cfg.mask_token_id} is outside the target vocabulary "
            f"({target.vocab_size}); use the mask id the drafter was trained with"
        )
    bad = [t for t in cfg.target_layer_ids if t >= target.num_layers]
    if bad:
        raise BlockdraftError(
            f"{source}: {cfg.field_name('target_layer_ids')} {list(cfg.target_layer_ids)} include {bad}, but the target "
            f"has {target.num_layers} layers (0..{target.num_layers - 1}); use the drafter trained for this target"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_layers:
        raise BlockdraftError(
            f"{source}: num_target_layers={cfg.num_target_layers} but the target has {target.num_layers} layers; "
            "this drafter was trained for another target"
        )


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    single = folder / "model.safetensors"
    if single.exists():
        return load_file(str(single))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            weights.update(load_file(str(folder / shard)))
        return weights
    raise BlockdraftError(f"--drafter {folder}: no model.safetensors (or sharded index) found; pass a drafter folder")


# Published checkpoints that name a tensor differently (vLLM 0.33's DFlashQwen3Model.hf_to_vllm_mapper): a
# single-layer "midlayer", and Muse-Glimmer's aux-hidden-state encoder.
_RENAMES = (
    (re.compile(r"^midlayer\."), "layers.0."),
    (re.compile(r"^encoder\.output_norm_enc\."), "hidden_norm."),
    (re.compile(r"^encoder\.fc\."), "fc."),
)
# Tensors a drafter checkpoint may carry that DFlash does not use: copies of the target's embedding and head.
_IGNORED = re.compile(r"^(embed_tokens|lm_head)\.")
# vLLM 0.33 drops DSpark's mask_embedding ("an unused placeholder") and reads its confidence head only for adaptive
# verification, which changes no draft.
_DSPARK_UNUSED = re.compile(r"^(mask_embedding|confidence_head\.)")


def _published_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights under our (the z-lab) names."""
    renamed = {}
    for key, value in weights.items():
        for pattern, replacement in _RENAMES:
            key = pattern.sub(replacement, key)
        renamed[key] = value
    return renamed


def load_drafter_weights(drafter: DFlashDrafter, weights: dict[str, torch.Tensor], source: str) -> None:
    """Strict on what matters: every parameter must be present with its shape, and no tensor may be left unused
    (an unknown tensor is a part of the drafter this engine would silently not run); buffers are rebuilt."""
    own = drafter.state_dict()
    weights = _published_names(weights)
    unknown = sorted(k for k in weights if k not in own and not _IGNORED.match(k)
                     and not (drafter.cfg.dspark is not None and _DSPARK_UNUSED.match(k)))
    if unknown and drafter.cfg.dflash2 is None and any("_conv." in k or "candidate_selector." in k for k in unknown):
        raise BlockdraftError(
            f"{source}: the checkpoint holds DFlash-2 tensors ({unknown[0]}, ...) but its config.json is DFlash (v1); "
            "add dflash_config.conv_kernel_size, conv_group_size, selector_rank and selector_top_k as published"
        )
    if unknown:
        raise BlockdraftError(
            f"{source}: the checkpoint has tensors this DFlash drafter does not use ({unknown[:3]}, {len(unknown)} in "
            "all): a variant blockdraft does not run, or a config that "
            "does not match the weights"
        )
    missing = [k for k in own if k not in weights and "rotary_emb" not in k]
    if missing:
        raise BlockdraftError(f"{source}: weights missing for {missing[:3]} ({len(missing)} in all); the checkpoint is incomplete")
    for key, value in own.items():
        if key in weights and weights[key].shape != value.shape:
            raise BlockdraftError(
                f"{source}: weight {key} has shape {tuple(weights[key].shape)}, config implies {tuple(value.shape)}"
            )
    drafter.load_state_dict({k: v for k, v in weights.items() if k in own}, strict=False)


def load_drafter(path: str | Path, target: Target | None = None) -> DFlashDrafter:
    """Load a z-lab-format drafter folder onto the target's device and dtype, checked against the target."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise BlockdraftError(f"--drafter {folder} does not exist; pass a folder with config.json and model.safetensors")
    cfg = load_draft_config(folder)
    if (folder / MASK_EMBEDDING_FILE).exists():
        raise BlockdraftError(
            f"--drafter {folder}: {MASK_EMBEDDING_FILE} (a separately trained mask embedding, read by vLLM) is not "
            "supported by blockdraft yet; its mask slots would use the target's embedding row instead"
        )
    if target is not None:
        check_pair(cfg, target, str(folder))
    drafter = DFlashDrafter(cfg)
    load_drafter_weights(drafter, _read_weights(folder), str(folder))
    if target is not None:
        drafter.to(device=target.device, dtype=target.dtype)
    return drafter.eval()


def save_drafter(drafter: DFlashDrafter, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors in the published layout (what vLLM/SGLang/dflash load)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to(dtype).contiguous().cpu()
        for k, v in drafter.state_dict().items()
        if "rotary_emb" not in k
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = drafter.cfg.to_dict()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder
