"""A renamed setting keeps its old spelling: the old flag still sets it (unlisted in --help), and a
run directory's config.yaml saved under the old key is read under the new one
(tests/test_old_run_dir.py restarts, resumes and scores such a run directory whole)."""
import pytest
import yaml

from train.cli import parse, parser, read_command
from train.config import FIELDS, RENAMED
from train.errors import UsageError
from train.rundir import RunDir


def test_the_old_flags_set_the_renamed_settings_and_help_lists_only_the_new():
    assert parse(["--no-checkpoints"]).save_checkpoints is False
    assert parse(["--checkpoints"]).save_checkpoints is True
    with pytest.raises(UsageError, match="^--test-checkpoint best.pt names what --test-only evaluates"):
        parse(["--checkpoint", "best.pt"])
    shown = parser().format_help()
    assert "--save-checkpoints" in shown and "--test-checkpoint" in shown
    assert "--no-checkpoints" not in shown and "--checkpoint " not in shown


def test_every_renamed_setting_names_a_setting_of_today():
    assert RENAMED and all(new in FIELDS and old not in FIELDS for old, new in RENAMED.items())


def test_a_saved_config_with_the_old_keys_is_read_under_the_new_ones(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    saved = {**yaml.safe_load(yaml.safe_dump({"checkpoints": False, "checkpoint": "", "loader": "synthetic"})),
             "global_batch_size": 8}
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert RunDir(run).saved_settings()["save_checkpoints"] is False
    cfg, _ = read_command(["--resume", "--out-dir", str(run)])  # (no checkpoint needed to read the settings)
    assert cfg.save_checkpoints is False and cfg.loader == "synthetic"
