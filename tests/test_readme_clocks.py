"""bench/readme_clocks.py: every clock it times is still stated in its file (README.md, a config), so a README edit
that moves a clock without the bench, or the bench without the README, is seen. Nothing is timed here."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast
ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("readme_clocks", ROOT / "bench" / "readme_clocks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_claim_is_in_its_file_and_list_prints_them(capsys):
    bench = _bench()
    assert bench.main(["--list"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(last["claims"]) == {"smoke", "dry_run", "demo", "make_fast", "real_step"}
    assert all(c["found"] for c in last["claims"].values()), last
    with pytest.raises(SystemExit):
        bench.main(["--only", "no_such_clock"])
