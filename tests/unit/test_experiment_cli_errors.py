"""The experiment tools refuse what they cannot use with one line and exit 2, not a traceback."""

from __future__ import annotations

import pytest

from experiments import attack_reach, report, worst_case


@pytest.mark.parametrize(("main", "argv", "message"), [
    (worst_case.main, ["{missing}"], "no such results directory: {missing}"),
    (report.main, ["--results", "{missing}", "--docs", "{tmp}/docs"], "no such results directory: --results {missing}"),
    (attack_reach.main, ["--attack", "min_maxx"],
     "no config in conf/attack for attack 'min_maxx' (did you mean 'min_max'?) (or an attack of your own by its "
     "dotted path, my_pkg.attacks.MyAttack); configured"),
])
def test_a_tool_given_nothing_it_can_use_says_so(main, argv, message, tmp_path, capsys) -> None:
    missing = tmp_path / "no_such_sweep"
    with pytest.raises(SystemExit) as stopped:
        main([arg.format(missing=missing, tmp=tmp_path) for arg in argv])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert message.format(missing=missing) in err
    assert "Traceback" not in err
