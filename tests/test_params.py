"""params.yaml validation: every bad key or value names its path; the shipped file loads."""
from pathlib import Path

import pytest
import yaml

from ddpmrepro import params as P

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_params_load_and_are_frozen():
    p = P.load(ROOT / "params.yaml")
    assert p.data.source == "digits"
    with pytest.raises(Exception):
        p.train.lr = 1.0  # frozen


def test_every_section_matches_the_dataclass_defaults_keys():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert set(raw) == {f for f in P.Params.__dataclass_fields__}


@pytest.mark.parametrize("raw, message", [
    ({"train": {"lr": "fast"}}, "train.lr: expected a number"),
    ({"train": {"lr": -1.0}}, "train.lr: must be > 0"),
    ({"train": {"steps": 1.5}}, "train.steps: expected an integer"),
    ({"train": {"steps": True}}, "train.steps: expected an integer"),
    ({"train": {"precision": "fp8"}}, "train.precision: 'fp8' is not one of fp32 | fp16 | bf16"),
    ({"train": {"ema_rates": [1.5]}}, "train.ema_rates[0]: must lie in (0, 1)"),
    ({"train": {"ema_rates": []}}, "train.ema_rates: give at least one"),
    ({"train": {"lrr": 1e-3}}, "train.lrr: unknown key"),
    ({"trian": {}}, "trian: unknown key"),
    ({"model": {"channel_mult": [1, 0]}}, "model.channel_mult[1]: must be >= 1"),
    ({"model": {"preset": "huge"}}, "model.preset: 'huge' is not one of"),
    ({"data": {"channels": 2}}, "data.channels: 2 is not one of 1 | 3"),
    ({"data": "digits"}, "data: expected a mapping"),
    ({"sample": {"respacing": "fast"}}, "sample.respacing: 'fast' is not"),
    ({"train": {"lr": float("nan")}}, "train.lr: expected a finite number"),
    ({"introspect": {"params": "*"}}, "introspect.params: expected a list of a string"),
    # introspection steps count completed updates, 1..train.steps
    ({"introspect": {"steps": [0]}}, "introspect.steps[0]: must be >= 1, got 0"),
    ({"introspect": {"steps": [1, 1501]}}, "introspect.steps[1]: step 1501 is after the last step (train.steps: 1500)"),
    ({"introspect": {"dump_steps": [20], "dump_modules": ["out"]}, "train": {"steps": 10}},
     "introspect.dump_steps[0]: step 20 is after the last step (train.steps: 10)"),
    ({"introspect": {"dump_steps": [5]}}, "introspect.dump_steps: nothing is dumped without introspect.dump_modules"),
    ({"train": {"label_dropout": 1.0}}, "train.label_dropout: 1 replaces every label with the null class"),
    # both accepted, the second ignored without a word (found from outside)
    ({"introspect": {"noise_buckets": 4, "noise_bucket_edges": [500]}}, "introspect.noise_buckets: 4 with"),
    ({"sample": {"eta": 0.5, "sampler": "dpmpp_2m"}}, "sample.eta: 0.5 is DDIM's noise, not used by dpmpp_2m"),
    # grad-norm steers by the buckets: off, or measured only where they cannot steer (found from outside)
    ({"train": {"timestep_sampler": "grad-norm"}, "introspect": {"noise_buckets": 0}},
     "train.timestep_sampler: 'grad-norm' learns from the noise-level buckets, which are off"),
])
def test_bad_values_name_the_key_path(raw, message):
    with pytest.raises(P.ParamsError) as e:
        P.from_dict(raw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_the_buckets_steps_are_the_recorded_ones_on_their_own_cadence():
    """params.levels_measured_at, which training/recording.py asks, against the rule written out:
    recorded (every k-th, the last, steps, dump_steps), and then every noise_levels_every-th, the
    last, or in steps."""
    ip = P.IntrospectParams(every=2, steps=[5], dump_steps=[9, 10], dump_modules=["out"], noise_levels_every=3)
    got = [s for s in range(1, 14) if P.levels_measured_at(s, ip, last=13)]
    assert got == [5, 6, 9, 12, 13]


def test_scientific_notation_without_dot_is_a_number():
    # YAML 1.1 reads `2e-4` as a string; users write it that way all the time.
    p = P.from_dict(yaml.safe_load("train: {lr: 2e-4}"))
    assert p.train.lr == pytest.approx(2e-4)


def test_model_overrides_are_only_the_explicit_keys():
    p = P.from_dict({"model": {"preset": "ddpm-cifar10", "dropout": 0.2}})
    assert p.model.overrides() == {"dropout": 0.2}


def test_section_hash_changes_with_values_only():
    a, b = P.from_dict({}), P.from_dict({"train": {"lr": 1e-4}})
    assert a.section_hash("train") != b.section_hash("train")
    assert a.section_hash("model") == b.section_hash("model")


def test_invalid_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("train: {lr: [1\n")
    with pytest.raises(P.ParamsError, match="not valid YAML"):
        P.load(bad)
    with pytest.raises(P.ParamsError, match="file not found"):
        P.load(tmp_path / "missing.yaml")


@pytest.mark.parametrize("text", ["", "\n\n", "# data:\n#   source: mnist\n", "---\n"])
def test_an_empty_file_is_refused_but_an_empty_mapping_means_all_defaults(tmp_path, text):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(P.ParamsError, match=r"params.yaml: the file is empty \(no keys\); if that is an accident"):
        P.load(path)
    path.write_text("{}  # every default, on purpose\n")
    assert P.load(path) == P.Params()


def test_every_key_has_a_doc_string():
    import dataclasses
    import typing

    undocumented = [f"{section}.{f.name}" for section, cls in typing.get_type_hints(P.Params).items()
                    for f in dataclasses.fields(cls) if not f.metadata.get("doc", "").strip()]
    assert undocumented == []


def test_docs_params_md_is_generated_from_the_dataclasses_and_current():
    import subprocess
    import sys

    made = subprocess.run([sys.executable, "-m", "ddpmrepro.params", "--markdown"], capture_output=True, text=True,
                          check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}).stdout
    committed = (ROOT / "docs" / "PARAMS.md").read_text()
    assert committed == made, "regenerate: PYTHONPATH=src python -m ddpmrepro.params --markdown > docs/PARAMS.md"
    # one row per key, with its default as the dataclasses give it
    shipped = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, sub in P.Params().to_dict().items():
        for key, default in sub.items():
            (row,) = [ln for ln in made.splitlines() if ln.startswith(f"| `{section}.{key}` |")]
            shown = row.split(" | ")[2].strip("`")
            assert yaml.safe_load(shown if shown != "''" else '""') == default, row
            # the shipped params.yaml's own value, where it is another (found from outside: sample.sampler)
            value = (shipped.get(section) or {}).get(key, default)
            assert ("**params.yaml: " in row) == (value != default), row
            if value != default:
                assert row.endswith(f"**params.yaml: `{value}`.** |"), row
    assert "docs/PARAMS.md" in (ROOT / "params.yaml").read_text()


def test_a_key_given_twice_is_one_line_naming_it_and_its_line(tmp_path):
    """PyYAML keeps the last of two `lr:` silently; DVC refuses the file, so the stages run alone must too."""
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\nsample:\n  seed: 1\n")
    with pytest.raises(P.ParamsError, match=r"params.yaml: line 4 is not valid YAML \(the key 'lr' is given twice "
                                            r"in one section\)"):
        P.load(path)
    path.write_text("train:\n  lr: 0.1\nsample:\n  seed: 1\nsample:\n  seed: 2\n")
    with pytest.raises(P.ParamsError, match=r"line 5 is not valid YAML \(the key 'sample' is given twice"):
        P.load(path)
    path.write_text("train:\n  lr: 0.1\nsample:\n  seed: 1\n")  # the same keys in different sections are fine
    assert P.load(path).train.lr == 0.1


def test_yaml_merge_keys_read_as_dvc_reads_them(tmp_path):
    """`<<:` (YAML's merge key) was refused by the duplicate-key check with PyYAML's words ("could not
    determine a constructor for the tag ...merge"); DVC reads it, a key written out overriding the merged one."""
    from dvc.utils.serialize import load_yaml

    path = tmp_path / "params.yaml"
    path.write_text("sample:\n  seed: 3\n"
                    "train:\n  <<: {lr: 0.002, steps: 10}\n  lr: 0.003\n")
    params, dvc_view = P.load(path), load_yaml(path)
    assert (params.train.lr, params.train.steps) == (0.003, 10) == (dvc_view["train"]["lr"], dvc_view["train"]["steps"])
    path.write_text("train:\n  <<: {lr: 0.002}\n  lr: 0.003\n  lr: 0.004\n")  # written twice is still refused
    with pytest.raises(P.ParamsError, match=r"line 4 is not valid YAML \(the key 'lr' is given twice"):
        P.load(path)


@pytest.mark.parametrize("raw", [{"train": {"label_dropout": 1.0}, "model": {"class_cond": False}},
                                 {"train": {"label_dropout": 1.0, "import_from": "some/model"}},
                                 {"train": {"label_dropout": 0.99}}])
def test_label_dropout_of_one_only_where_no_class_embedding_trains(raw):
    # An unconditional model has no class table; an imported one is not trained here; 0.99 still
    # trains each class embedding on a share of the steps.
    assert P.from_dict(raw).train.label_dropout == raw["train"]["label_dropout"]
