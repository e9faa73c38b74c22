"""improved-diffusion / guided-diffusion `UNetModel` state dicts -> ddpmrepro's UNet, exactly.

Both UNets have the same modules in the same places (`input_blocks.{i}`, `middle_block`,
`output_blocks.{i}`, `time_embed`, `out`); what differs:

- names inside a residual block: their `out_layers.0` (the second GroupNorm) is our `out_norm`,
  their `out_layers.3` our `out_layers.2`, their `skip_connection` our `skip`;
- their `label_emb` has one row per class; ours has one more, the classifier-free-guidance null
  label. An imported class-conditional model was never trained with it: that row is zero (the
  embedding of "no label" is then the time embedding alone) and guidance is not meaningful;
- attention: `qkv` is a 1x1 conv to 3C channels in both, but improved-diffusion (and guided-diffusion's
  legacy order) lays the rows out per head, [q_h k_h v_h] for h = 1..H, while ours (and guided-diffusion's
  `use_new_attention_order`) lays them out per tensor, [q_1..q_H | k_1..k_H | v_1..v_H]. The rows are
  permuted, not approximated.

What the file cannot tell (widths are in the tensors; head count, image size and the diffusion are
not) comes from params.yaml: docs/MODELS.md gives the keys of each published checkpoint.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from ..model.unet import AttentionBlock, ResBlock, UNet
from . import ConversionError, float_weights

# (ours, theirs) inside a residual block.
RES_RENAMES = (("out_norm", "out_layers.0"), ("out_layers.2", "out_layers.3"), ("skip", "skip_connection"))


def key_map(model: UNet) -> dict[str, str]:
    """Our state-dict key -> theirs, for every tensor of `model`."""
    res_prefixes = [n for n, m in model.named_modules() if isinstance(m, ResBlock)]
    out = {}
    for key in model.state_dict():
        theirs = "label_emb.weight" if key == "label_embed.weight" else key
        for prefix in res_prefixes:
            if key.startswith(prefix + "."):
                rest = key[len(prefix) + 1:]
                for ours, their_name in RES_RENAMES:
                    if rest.startswith(ours + "."):
                        theirs = f"{prefix}.{their_name}.{rest[len(ours) + 1:]}"
                break
        out[key] = theirs
    return out


def qkv_heads(model: UNet) -> dict[str, int]:
    """`<attention block>.qkv.weight` / `.bias` -> that block's number of heads."""
    return {f"{n}.qkv.{p}": m.num_heads for n, m in model.named_modules() if isinstance(m, AttentionBlock)
            for p in ("weight", "bias")}


def qkv_per_head_to_per_tensor(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [q_1 k_1 v_1 | ... | q_H k_H v_H] -> [q_1..q_H | k_1..k_H | v_1..v_H] (any trailing dims)."""
    c3 = w.shape[0]
    return w.reshape(heads, 3, c3 // (3 * heads), *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def qkv_per_tensor_to_per_head(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `qkv_per_head_to_per_tensor`."""
    c3 = w.shape[0]
    return w.reshape(3, heads, c3 // (3 * heads), *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def to_ours(state: dict[str, torch.Tensor], model: UNet, *, source: str, attention_order: str = "legacy"
            ) -> dict[str, torch.Tensor]:
    """Their state dict as `model`'s, strictly: every tensor used, every shape checked.

    :param state: an improved-diffusion or guided-diffusion `UNetModel.state_dict()`.
    :param model: the ddpmrepro UNet it must become (built from params.yaml).
    :param source: the file's name, for the messages.
    :param attention_order: "legacy" (improved-diffusion; guided-diffusion by default) or "new"
        (guided-diffusion's `use_new_attention_order`, already our layout).
    :raises ConversionError: naming the first missing, unexpected or mis-shaped key.
    """
    mapping, heads, expected = key_map(model), qkv_heads(model), model.state_dict()
    missing = [t for t in mapping.values() if t not in state]
    if missing:
        raise ConversionError(f"{source}: tensor {missing[0]} is missing ({len(missing)} missing in all): not an "
                              "improved-diffusion UNetModel of the architecture params.yaml's model: section describes "
                              "(docs/MODELS.md lists the keys of each published model)")
    unexpected = sorted(set(state) - set(mapping.values()))
    if unexpected:
        raise ConversionError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all): the file has "
                              "layers params.yaml's model: section does not (e.g. more res blocks, attention at "
                              "another resolution, class_cond)")
    ours = {}
    for key, theirs in mapping.items():
        v = float_weights(state[theirs], theirs, source)
        if key == "label_embed.weight" and v.ndim == 2:
            v = torch.cat([v, torch.zeros(1, v.shape[1])])  # the null label, never trained: zero
        if v.shape != expected[key].shape:
            want = list(expected[key].shape)
            if key == "label_embed.weight":
                want[0] -= 1
            raise ConversionError(f"{source}: {theirs} has shape {list(state[theirs].shape)}, the model of "
                                  f"params.yaml needs {want}; set the model: keys of this checkpoint (docs/MODELS.md)")
        if key in heads and attention_order == "legacy":
            v = qkv_per_head_to_per_tensor(v, heads[key])
        ours[key] = v.contiguous()
    return ours


def from_ours(model: UNet, attention_order: str = "legacy") -> dict[str, torch.Tensor]:
    """`model`'s weights under improved-diffusion's names and layout (the null-label row dropped)."""
    mapping, heads = key_map(model), qkv_heads(model)
    out = {}
    for key, v in model.state_dict().items():
        if key == "label_embed.weight":
            v = v[:-1]
        if key in heads and attention_order == "legacy":
            v = qkv_per_tensor_to_per_head(v, heads[key])
        out[mapping[key]] = v.clone()
    return out


def damaged_record(path: Path) -> str | None:
    """The first record of a torch zip checkpoint whose bytes do not match the CRC-32 the archive
    stores for it, or None. `torch.load` does not check these: bytes overwritten inside a tensor
    load as other weights. A legacy file (torch < 1.6, or `_use_new_zipfile_serialization=False`) is
    a bare pickle stream with no checksum to check: None.

    :raises zipfile.BadZipFile, OSError: a zip that cannot be read (truncated, say).
    """
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # what torch.load itself takes for its zip format
            return None
    with zipfile.ZipFile(path) as archive:
        return archive.testzip()  # reads every record, as torch.load will, once more


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A `.pt` state dict, loaded with `weights_only=True`: a pickle that would run code is refused.
    A zip-format file's records are checked against their CRC-32 first (`damaged_record`).

    :raises ConversionError: one line naming the file (not found, truncated, a damaged record, not a
        state dict, or a pickle asking for more than tensors).
    """
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: not found")
    try:
        damaged = damaged_record(path)
        if damaged is None:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refuses any global outside tensors and plain containers, before running it.
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ConversionError(f"{path}: refused: the pickle asks for more than tensors ({first}); only plain "
                              "state dicts are loaded, nothing in the file is run") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ConversionError(f"{path}: not a readable torch checkpoint, truncated or damaged ({first}); "
                              "download it again and check its sha256") from None
    if damaged is not None:
        raise ConversionError(f"{path}: record {damaged} is damaged (its bytes do not match the CRC-32 the file "
                              "stores for them); download it again and check its sha256")
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise ConversionError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    return state
