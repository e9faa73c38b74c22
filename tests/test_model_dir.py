"""model_dir.py: the model directory is written whole, in the bytes train and import always wrote,
and read back into the network it was written from."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from ddpmrepro import files as F
from ddpmrepro import params as P
from ddpmrepro.model.unet import build_unet
from ddpmrepro.model_dir import data_section, load_model, read_config, weights_file, write_model

MANIFEST = {"source": "digits", "num_classes": 10, "image_size": 8, "channels": 1, "class_names": list("0123456789"),
            "files": {"x": "y"}}


PARAMS = P.from_dict({"model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1,
                                 "attention_resolutions": [4], "num_head_channels": 16}})


def tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_unet(PARAMS.model, image_size=8, in_channels=1, num_classes=10,
                      learn_sigma=PARAMS.diffusion.variance == "learned_range")


def config(ema_rates: list[float]) -> dict:
    # The key order of train's config.json: part of the bytes DVC hashes.
    return {"params": P.trained_dict(PARAMS), "data": data_section(MANIFEST), "data_sha256": MANIFEST["files"],
            "code_version": "c", "run_hash": "r", "ema_rates": ema_rates, "final": {"loss": 0.5}, "torch": "t"}


def test_written_whole_and_read_back(tmp_path):
    raw, ema = tiny(0), tiny(1)
    out = tmp_path / "models" / "ddpm"
    write_model(out, config([0.999]), raw.state_dict(), {0.999: ema.state_dict()})
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "config.json", "ema_0.999.safetensors",
                                                     "model.safetensors"]
    # no newline, as ever; the last key says the directory has its sums
    assert (out / "config.json").read_text() == json.dumps({**config([0.999]), "checksums": "SHA256SUMS"}, indent=2)
    assert read_config(out) == {**config([0.999]), "checksums": "SHA256SUMS"}
    for rate, net in ((0, raw), (0.999, ema)):
        model, trained, _ = load_model(out, rate)
        assert P.trained_dict(trained) == P.trained_dict(PARAMS) and not model.training
        assert all(torch.equal(v, net.state_dict()[k]) for k, v in model.state_dict().items())
    # A rewrite replaces the whole directory: nothing of the old one stays.
    write_model(out, config([]), raw.state_dict(), {})
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "config.json", "model.safetensors"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["ddpm"]


def test_config_keeps_the_trained_params_alone_and_reads_them_without_the_sampling_ones(tmp_path):
    """config.json holds what `train` read: two experiments that train the same weights and sample them
    otherwise get the same model directory (DVC's hash: nothing after train runs again). A model of
    T=20 steps reads back although the default `sample.respacing` (ddim50) cannot respace 20 steps:
    the sampling params are the stage's, checked there, never the model's."""
    few = P.from_dict({**PARAMS.to_dict(), "diffusion": {"timesteps": 20},
                       "sample": {"respacing": "ddim5", "guidance": 3.0}})
    stored = P.trained_dict(few)
    assert list(stored) == ["data", "model", "diffusion", "train", "introspect", "superres"]
    assert list(stored["superres"]) == ["low_res", "quantise", "noise_aug"]
    other = P.from_dict({**few.to_dict(), "sample": {"respacing": "ddim10", "sampler": "ddpm"},
                         "evaluate": {"bpd_images": 10}, "report": {"top_k": 3},
                         "superres": {"sample_noise_aug": 0.05, "project": True}})
    assert P.trained_dict(other) == stored
    with pytest.raises(P.ParamsError, match="sample.respacing"):  # what a whole-params reader refused
        P.from_dict(stored)
    back = P.trained_from_dict(stored)
    assert P.trained_dict(back) == stored and back.diffusion.timesteps == 20
    write_model(tmp_path / "m", {**config([0.9]), "params": stored}, tiny(0).state_dict(), {0.9: tiny(1).state_dict()})
    _, trained, _ = load_model(tmp_path / "m", 0.9)
    assert P.trained_dict(trained) == stored
    # A directory written before (the whole params in config.json) reads as it did.
    write_model(tmp_path / "old", {**config([0.9]), "params": few.to_dict()}, tiny(0).state_dict(),
                {0.9: tiny(1).state_dict()})
    assert P.trained_dict(load_model(tmp_path / "old", 0.9)[1]) == stored
    # A trained key out of range, a key of no section, or a cross-check of training, is still refused.
    for bad, words in (({**stored, "train": {**stored["train"], "lr": -1.0}}, "train.lr: must be >"),
                       ({**stored, "samplr": {}}, "samplr: unknown key"),
                       ({**stored, "superres": {"low_res": 8}}, "superres.low_res: 8 is not below"),
                       ({**stored, "superres": {"lowres": 2}}, "superres.lowres: unknown key")):
        with pytest.raises(P.ParamsError, match=words):
            P.trained_from_dict(bad)


def test_the_file_names(tmp_path):
    assert weights_file(0) == "model.safetensors" and weights_file(0.9999) == "ema_0.9999.safetensors"
    assert data_section(MANIFEST) == {k: MANIFEST[k] for k in ("source", "num_classes", "image_size", "channels",
                                                                 "class_names")}


def test_a_config_that_does_not_describe_its_weights_is_refused_before_writing(tmp_path):
    w = tiny(0).state_dict()
    with pytest.raises(ValueError, match="ema_rates"):
        write_model(tmp_path / "m", config([0.9]), w, {0.99: w})
    with pytest.raises(ValueError, match="missing"):
        write_model(tmp_path / "m", {"ema_rates": []}, w, {})
    assert list(tmp_path.iterdir()) == []


def test_readers_get_one_line_errors(tmp_path):
    with pytest.raises(F.CheckpointError, match=r"config.json: not found; train first \(`dvc repro train`\)"):
        load_model(tmp_path / "none", 0)
    write_model(tmp_path / "m", config([0.9]), tiny(0).state_dict(), {0.9: tiny(1).state_dict()})
    with pytest.raises(P.ParamsError, match=r"sample.ema_rate=0.5 was not trained; available: 0.9 \(or 0"):
        load_model(tmp_path / "m", 0.5)


def test_the_weights_sums_are_sha256sums_and_a_damaged_or_unlisted_file_is_refused(tmp_path):
    import hashlib
    import subprocess

    out = tmp_path / "m"
    write_model(out, config([0.9]), tiny(0).state_dict(), {0.9: tiny(1).state_dict()})
    # what `sha256sum -c` reads, and it agrees
    listed = (out / "SHA256SUMS").read_text()
    assert listed == "".join(f"{hashlib.sha256((out / n).read_bytes()).hexdigest()}  {n}\n"
                             for n in ("config.json", "ema_0.9.safetensors", "model.safetensors"))
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # one flipped byte in the EMA: its loader refuses in one line, the raw weights still load
    ema = out / "ema_0.9.safetensors"
    data = bytearray(ema.read_bytes())
    data[-1] ^= 1
    ema.write_bytes(bytes(data))
    with pytest.raises(F.CheckpointError, match=r"ema_0.9.safetensors: sha256 differs from .*SHA256SUMS \(damaged "
                                                r"or modified since it was written\); restore the model directory"):
        load_model(out, 0.9)
    load_model(out, 0)
    # hard-linked to DVC's cache (.dvc/config), a damaged file is damaged there too: checkout cannot help
    import os

    os.link(ema, tmp_path / "cache-copy")
    with pytest.raises(F.CheckpointError, match=r"ema_0.9.safetensors: sha256 differs .* its bytes are shared by 2 "
                                                r"hard links \(DVC's cache, the run's checkpoint directory\), so `dvc checkout` cannot "
                                                rf"restore them: `dvc pull --force {re.escape(str(out))}` from a remote, or "
                                                r"retrain with `ddpmrepro train --restart`"):
        load_model(out, 0.9)
    # a weights file the sums do not list cannot be checked: refused too
    (out / "SHA256SUMS").write_text("".join(line + "\n" for line in listed.splitlines()[:2]))  # config, EMA
    with pytest.raises(F.CheckpointError, match=r"model.safetensors: not listed in"):
        load_model(out, 0)
    # emptied or deleted, the sums checked nothing (found from outside): config.json says they must be there
    for emptied in (True, False):
        if emptied:
            (out / "SHA256SUMS").write_text("")
        else:
            (out / "SHA256SUMS").unlink()
        with pytest.raises(F.CheckpointError, match=r"m/SHA256SUMS: missing, or it does not list config.json, in a "
                                                    r"directory written with its sums: nothing in it can be checked; "
                                                    r"restore the model directory"):
            load_model(out, 0)
    # a directory written before the sums were kept (no `checksums` in its config.json) is read as it is
    c = json.loads((out / "config.json").read_text())
    del c["checksums"]
    (out / "config.json").write_text(json.dumps(c, indent=2))
    load_model(out, 0)


@pytest.mark.parametrize("edit, words", [
    (lambda c: c["params"]["diffusion"].update(timesteps=1000), "config.json: sha256 differs from"),
    (lambda c: c.pop("data"), "config.json: sha256 differs from"),
])
def test_an_edited_config_is_refused_by_its_sum(tmp_path, edit, words):
    """A model trained with T=50 was sampled as T=1000 after an edit of config.json, exit 0."""
    out = tmp_path / "m"
    write_model(out, config([0.9]), tiny(0).state_dict(), {0.9: tiny(1).state_dict()})
    c = json.loads((out / "config.json").read_text())
    edit(c)
    (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(F.CheckpointError, match=words):
        load_model(out, 0.9)


@pytest.mark.parametrize("text, words", [
    ('{"params": ', "not valid JSON (Expecting value: line 1 column 12"),
    (b"\xff\xfe", "not valid JSON ('utf-8' codec can't decode"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"params": null, "data": {}, "ema_rates": []}', "'params' is NoneType, not a dict"),
    ('{"params": {}, "ema_rates": []}', "'data' is missing, not a dict"),
    ('{"params": {}, "data": {"num_classes": 10, "image_size": "8", "channels": 1}, "ema_rates": []}',
     "data.image_size is '8', not a whole number"),
    ('{"params": {}, "data": {"num_classes": 2, "image_size": 8, "channels": 1, "class_names": ["a"]}, "ema_rates": []}',
     "data.class_names does not name data.num_classes=2 classes"),
    ('{"params": {}, "data": {"num_classes": 1, "image_size": 8, "channels": 1, "class_names": ["a"]}, "ema_rates": "0.9"}',
     "'ema_rates' is str, not a list"),
    ('{"params": {"model": {"channels": -4}}, "data": {"num_classes": 1, "image_size": 8, "channels": 1, '
     '"class_names": ["a"]}, "ema_rates": []}', "params: model.channels"),
])
def test_a_damaged_config_in_a_directory_without_its_sum_is_one_line_naming_it(tmp_path, text, words):
    """Directories written before config.json was summed are still read, so its shape is checked
    too: one CheckpointError naming the file and the fix, not a KeyError's traceback."""
    out = tmp_path / "m"
    write_model(out, config([0.9]), tiny(0).state_dict(), {0.9: tiny(1).state_dict()})
    sums = (out / "SHA256SUMS").read_text().splitlines()
    (out / "SHA256SUMS").write_text("".join(f"{line}\n" for line in sums if not line.endswith("config.json")))
    (out / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(F.CheckpointError) as e:
        load_model(out, 0.9)
    assert str(e.value).startswith(f"{out / 'config.json'}: ") and words in str(e.value), str(e.value)
    # the fix names the directory read (the cascade's are models/base and models/upsampler: found from outside)
    assert str(e.value).endswith(f"restore the model directory (`dvc checkout {out}`) or retrain")


def test_weights_of_another_shape_than_configs_network_are_one_line_naming_the_tensor(tmp_path):
    out = tmp_path / "m"
    wide = dataclasses.replace(PARAMS, model=dataclasses.replace(PARAMS.model, channels=PARAMS.model.channels * 2))
    net = build_unet(wide.model, image_size=8, in_channels=1, num_classes=10,
                     learn_sigma=PARAMS.diffusion.variance == "learned_range")
    write_model(out, config([0.9]), net.state_dict(), {0.9: net.state_dict()})
    with pytest.raises(F.CheckpointError, match=r"ema_0.9.safetensors: \S+ is \[\d+(, \d+)*\], but config.json's "
                                                r"network has \[\d+(, \d+)*\] \(\d+ tensors differ\); restore"):
        load_model(out, 0.9)


def test_weights_with_a_nan_are_one_line_not_black_samples(tmp_path):
    state = dict(tiny(0).state_dict())
    key = sorted(state)[len(state) // 2]
    state[key] = state[key].clone()
    state[key].view(-1)[0] = float("nan")
    write_model(tmp_path / "m", config([0.9]), tiny(0).state_dict(), {0.9: state})
    with pytest.raises(F.CheckpointError, match=rf"ema_0.9.safetensors: {key} holds NaN or infinite values"):
        load_model(tmp_path / "m", 0.9)
    load_model(tmp_path / "m", 0)  # the raw weights are finite


def test_a_reader_restores_the_old_directory_a_killed_fallback_swap_left_aside(tmp_path):
    write_model(tmp_path / "m", config([]), tiny(0).state_dict(), {})
    (tmp_path / "m").rename(tmp_path / ".m.old")  # killed between the fallback's two renames
    assert read_config(tmp_path / "m") == {**config([]), "checksums": "SHA256SUMS"}
