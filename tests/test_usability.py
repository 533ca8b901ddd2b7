"""Issue 11: every problem at once, did-you-mean for keys and keywords, launch artefacts, ..."""

from __future__ import annotations

import inspect

import pytest

import popart_kit as pk
from popart_kit.errors import ConfigTypeError, InvalidConfig


# -- 1. unknown keys reported with every other problem, each with a suggestion ------------------

def test_an_unknown_key_does_not_hide_the_other_problems() -> None:
    with pytest.raises(InvalidConfig) as info:
        pk.SessionConfig(mode="inference", batch_size=8, batches_per_step=2, ipus_per_replica=2,
                         accumulation={"factor": 4, "facter": 3},
                         pipeline={"enabled": True, "stages": 4},
                         popart_options={"enableStochasticRoundin": True})
    err = info.value
    assert sorted(err.rules) == sorted(["V18", "V7", "K-option-unknown", "K-unknown-key",
                                        "K-unknown-key"])
    text = str(err)
    assert "did you mean micro_batch_size" in text
    assert "did you mean accumulation.factor" in text
    assert "Extra inputs" not in text


@pytest.mark.parametrize("make, expect", [
    (lambda: pk.SessionConfig(mode="training", batch_per_step=4), "batches_per_step"),
    (lambda: pk.SGD(0.1, momentun=0.9), "momentum"),
    (lambda: pk.Adam(0.1, lr=0.2), "learning_rate"),
    (lambda: pk.Replication(local_fator=2), "local_factor"),
    (lambda: pk.SessionConfig(mode="training", replicatedGraphCount=2),
     "replication.local_factor"),
    (lambda: pk.SessionConfig(mode="training", enableStochasticRounding=True),
     "precision.stochastic_rounding"),
    (lambda: pk.SessionConfig(mode="training", enableOutlining=False),
     "popart_options.enableOutlining"),
])
def test_a_misspelt_field_gets_a_suggestion_and_no_pydantic_url(make, expect) -> None:
    with pytest.raises(InvalidConfig, match="K-unknown-key") as info:
        make()
    assert expect in str(info.value)
    assert "errors.pydantic.dev" not in str(info.value)


def test_unknown_keys_in_a_file_are_reported_with_the_rules(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('mode = "inference"\nbatch_size = 4\nbatches_per_step = 2\n'
                    'ipus_per_replica = 2\n[accumulation]\nfactor = 4\n'
                    '[pipeline]\nenabled = true\nstages = 4\n')
    with pytest.raises(InvalidConfig) as info:
        pk.SessionConfig.from_file(path)
    assert set(info.value.rules) == {"V18", "V7", "K-unknown-key"}


def test_session_keywords_get_the_kits_error_and_keep_their_signature() -> None:
    with pytest.raises(ConfigTypeError, match=r"'backnd' \(did you mean backend\?\)") as info:
        pk.InferenceSession(b"", None, backnd="xla", anchor={})
    assert isinstance(info.value, TypeError)
    assert "anchors?" in str(info.value)
    assert "micro_batches_per_chunk" in inspect.signature(pk.InferenceSession).parameters
    assert "loss" in inspect.signature(pk.TrainingSession).parameters
