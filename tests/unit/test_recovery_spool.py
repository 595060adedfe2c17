"""What recovery does with a dead worker's outputs when it cannot send them: the spool keeps them,
with where they were going, so `e31 outputs retry` needs nothing more."""

from __future__ import annotations

from e31_prefect import spool
from e31_prefect.ledger import Holding
from e31_prefect.recovery import _send_what_was_written


def test_outputs_of_a_run_whose_storage_block_is_gone_are_kept_with_their_destination(tmp_path):
    workspace = tmp_path / "workspace"
    (workspace / "output" / "sub").mkdir(parents=True)
    (workspace / "output" / "sub" / "model.json").write_text("{}")
    holding = Holding(flow_run_id="run-1", worker_pid=1, worker_started="x", job_name="retrain", devices=[0],
                      workspace=str(workspace), destination="s3://results/retrain/", storage="e31-store")
    kept_url = _send_what_was_written(holding, tmp_path / "spool", None, sendable=False)
    kept = spool.read(tmp_path / "spool", "run-1")
    assert kept is not None and kept_url == kept.outputs_url
    assert (kept.destination, kept.storage, kept.job_name) == ("s3://results/retrain/", "e31-store", "retrain")
    assert [f["path"] for f in kept.files] == ["sub/model.json"]
    assert (kept.outputs / "sub" / "model.json").read_text() == "{}"
