"""Attacks by ``attack._target_``: a user's client-side and omniscient attacks from a module outside the package.

The module is examples/user-components/my_attacks.py (the documented example) copied into a temporary
directory under another name, plus a few broken attacks. The tests check building, that bad targets
fail in validation with a message naming what is wrong, that ``flwr run`` refuses an omniscient one, and
that both kinds are rows of the study: their runs go through the production ClientApp and server with the
in-process transport, and each ends with another model than the honest run's. A drill device plays the
client-side one its node config names, and names the reason when it cannot play what it was given.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from experiments import study
from experiments.inprocess import _server_identity, run_inprocess
from experiments.source_digest import source_digest
from fedrobust import attacks, components, protocol
from fedrobust.attacks import Attack
from fedrobust.clients import byzantine_app, client_app
from fedrobust.clients.client_app import make_client_app
from fedrobust.config import ConfigError, from_flat
from fedrobust.run_setup import validate
from fedrobust.strategies import reporting
from fedrobust.strategies.server_app import checked_run_config
from tests.support.user_code import copy_example, put_on_path

MODULE = "fr_user_attacks"  # not a name of anything installed
BROKEN = '''

class Inert(Attack):
    """Overrides no hook: its clients would be honest."""


class OneRowForAll(Attack):
    """Omniscient, but crafts one [d] row instead of f of them."""

    omniscient = True

    def craft(self, honest, *, f, generator):
        return -honest.mean(dim=0)


def not_an_attack(scale=1.0):
    return scale


class ScaledMean:
    """A user rule with a parameter of its own: the mean, times scale."""

    def __init__(self, f=0, scale=1.0):
        self.f, self.scale = f, scale

    def __call__(self, updates):
        return self.scale * updates.mean(dim=0)
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_example(tmp_path_factory.mktemp("user_attacks"), "my_attacks.py", MODULE, BROKEN)


@pytest.fixture()
def on_path(user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return put_on_path(user_dir, monkeypatch)


def _flat(**extra: object) -> dict[str, object]:
    return {"num_clients": 6, "clients_per_round": 6, "num_byzantine": 1, "aggregator.name": "mean", **extra}


def _built(**extra: object) -> Attack | None:
    return components.build_attack(from_flat(_flat(**extra)))


def test_a_user_attack_is_built_with_its_params_and_a_built_in_by_name(on_path: Path) -> None:
    reverse = _built(**{"attack._target_": f"{MODULE}.ScaledReverse", "attack.params": {"factor": -2.0}})
    assert reverse is not None and not reverse.omniscient
    update = {"w": torch.ones(3), "steps": torch.tensor([5])}
    sent = reverse.poison_update(update, round=1, generator=torch.Generator())
    assert torch.equal(sent["w"], -2.0 * torch.ones(3)) and torch.equal(sent["steps"], torch.tensor([5]))
    against = _built(**{"attack._target_": f"{MODULE}:AgainstTheMean"})
    assert against is not None and against.omniscient
    honest = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(against.craft(honest, f=2, generator=torch.Generator()), torch.tensor([[-6.0, -9.0]] * 2))
    assert _built(**{"attack.name": "sign_flip"}).name == "sign_flip"  # type: ignore[union-attr]
    assert _built() is None  # attack=none: honest clients


def test_an_attack_tuned_to_the_servers_rule_is_tuned_to_a_user_rule_with_its_parameters(on_path: Path) -> None:
    """conf/attack tunes optimal_* to ${aggregator.name} with ${aggregator.params}: with a rule of the user's own
    those parameters are its own, and the attack is built against it, not against the name it leaves unused."""
    rule = f"{MODULE}.ScaledMean"
    cfg = validate(from_flat(_flat(**{
        "aggregator._target_": rule, "aggregator.params": {"scale": 0.5}, "aggregator.pre": "nnm",
        "attack.name": "optimal_alie", "attack.params": {"rule": "mean", "rule_params": {"scale": 0.5}},
    })))
    attack = components.build_attack(cfg)
    assert attack.rule == f"nnm+{rule}" and attack.rule_params == {"scale": 0.5}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"attack._target_": "fr_no_such_pkg.Attack"},
         r"attack\._target_=fr_no_such_pkg\.Attack: cannot import .*No module named 'fr_no_such_pkg'"),
        ({"attack._target_": f"{MODULE}.ScaledRevers"},
         rf"attack\._target_={MODULE}\.ScaledRevers: .*'{MODULE}' has no attribute 'ScaledRevers' \(did you mean "
         r"'ScaledReverse'\?\)$"),
        ({"attack._target_": f"{MODULE}.ScaledReverse", "attack.params": {"factr": -2.0}},
         rf"attack\._target_={MODULE}\.ScaledReverse: ScaledReverse\(factor: float = -4\.0\) cannot be called "
         r"with \['factr'\]: got an unexpected keyword argument 'factr' \(did you mean 'factor'\?\)$"),
        ({"attack._target_": f"{MODULE}.ScaledReverse", "attack.params": {"factor": 2.0}},
         r"ScaledReverse\(factor=2\.0\) raised ValueError: factor must be negative"),
        ({"attack._target_": f"{MODULE}.Inert"},
         r"Inert is a client-side attack but overrides none of poison_data, poison_update, poison_num_examples: "
         r"its clients would behave honestly"),
        ({"attack._target_": f"{MODULE}.not_an_attack"}, r"not_an_attack\(scale=1\.0\) returned a float; expected"),
        ({"attack._target_": f"{MODULE}.OneRowForAll"},
         r"OneRowForAll: contract check on a random round of 6 honest and 2 Byzantine rows of 5 coordinates \(the "
         r"check's own small round, not the run's\): craft_round must return the 2 Byzantine rows, shape \(2, 5\) "
         r"\(craft: \[h, d\] -> \[f, d\]\); it returned shape \(5,\)"),
        ({"attack._target_": f"{MODULE}.ScaledReverse", "attack.name": "sign_flip"},
         rf"attack\.name=sign_flip: and attack\._target_={MODULE}\.ScaledReverse both pick an attack: keep one"),
        ({"attack._target_": f"{MODULE}.ScaledReverse", "num_byzantine": 0},
         rf"attack\._target_={MODULE}\.ScaledReverse: needs num_byzantine > 0"),
    ],
    ids=["no package", "no attribute", "wrong param", "param refused", "no hook", "not an attack", "wrong shape",
         "two attacks", "no byzantine"],
)
def test_a_bad_attack_target_fails_in_validation_naming_it(on_path: Path, overrides: dict, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        validate(from_flat(_flat(**overrides)))
    assert any(re.search(problem, line) for line in refused.value.problems), refused.value.problems


def test_flwr_run_refuses_an_omniscient_user_attack_and_takes_a_client_side_one(on_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        checked_run_config(_flat(**{"attack._target_": f"{MODULE}.AgainstTheMean"}))
    assert refused.value.problems == [
        f"attack._target_={MODULE}.AgainstTheMean: omniscient attacks run only in Hydra simulation (python -m "
        f"experiments.run); under flwr run use a client-side attack ({', '.join(attacks.client_names())}, or one "
        "of your own with omniscient = False)"
    ]
    cfg = checked_run_config(_flat(**{"attack._target_": f"{MODULE}.ScaledReverse"}))
    assert cfg.attack.active and cfg.attack.label == f"{MODULE}.ScaledReverse"


def test_user_attacks_are_rows_of_the_study_and_move_the_plain_mean(
    on_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reverse, against = f"{MODULE}.ScaledReverse", f"{MODULE}.AgainstTheMean"
    out = tmp_path / "out"
    command = ["--rules", "mean", "--attacks", "none", reverse, against, "--partitions", "iid", "--seeds", "0",
               "--rounds", "3", "--clients", "6", "--byzantine", "2", "--jobs", "1", "--out", str(out)]
    study.main(command)
    results = {r["attack"]: r for r in study.load_results(out)}
    assert {a: r["status"] for a, r in results.items()} == {"none": study.OK, reverse: study.OK, against: study.OK}
    assert f"attack._target_={reverse}" in results[reverse]["overrides"]
    honest = results["none"]
    for attack in (reverse, against):  # each ran: another model, and a worse one under the plain mean
        assert results[attack]["final_model_sha256"] != honest["final_model_sha256"]
        assert results[attack]["rows"][-1]["accuracy"] < honest["rows"][-1]["accuracy"] - 0.1, attack
    assert results[reverse]["user_code"] == {reverse: source_digest(reverse)} != {}
    assert results["none"]["user_code"] == {}
    # The same command keeps the results; after the attacks' file changes, their runs are made again.
    capsys.readouterr()
    study.main(command)
    assert "3 runs, 3 done already, 0 to run" in capsys.readouterr().out
    source = on_path / f"{MODULE}.py"
    source.write_text(source.read_text() + "\n# edited\n")
    study.main(command)
    said = capsys.readouterr().out
    assert "3 runs, 1 done already, 2 to run" in said
    assert f"1 of them again: the code of {reverse} changed since they ran" in said
    assert f"1 of them again: the code of {against} changed since they ran" in said


def test_the_study_refuses_a_set_that_would_give_every_run_one_attack(tmp_path: Path, capsys) -> None:
    for override in ("attack._target_=my_pkg.attacks.MyAttack", "attack=sign_flip", "attack.name=ipm"):
        with pytest.raises(SystemExit) as stopped:
            study.main(["--rules", "mean", "--attacks", "none", "sign_flip", "--partitions", "iid", "--seeds", "0",
                        "--set", override, "--out", str(tmp_path / "out")])
        assert stopped.value.code == 2
        assert f"--set {override}: --attacks sets the attack of each run; an attack of your own is one of them by " \
               "its dotted path" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_attack_parameters_of_the_study_go_to_its_attacks_not_to_the_honest_baseline(
    on_path: Path, tmp_path: Path
) -> None:
    from experiments import report

    reverse, out = f"{MODULE}.ScaledReverse", tmp_path / "out"
    study.main(["--rules", "mean", "--attacks", "none", reverse, "--set", "+attack.params.factor=-3.0",
                "--partitions", "iid", "--seeds", "0", "--rounds", "1", "--clients", "6", "--byzantine", "1",
                "--jobs", "1", "--out", str(out)])
    results = {r["attack"]: r for r in study.load_results(out)}
    assert results["none"]["status"] == results[reverse]["status"] == study.OK
    assert "+attack.params.factor=-3.0" in results[reverse]["overrides"]
    assert not any("attack.params" in o for o in results["none"]["overrides"])
    page = report.write_report(out, tmp_path / "docs").read_text()
    assert "* Set for every run (`--set`) (those of `attack.params` for every attack, `none` aside), over the " \
           "settings above: `+attack.params.factor=-3.0`." in page
    assert f"attacks with their `conf/attack/*.yaml` settings (`{reverse}`: the defaults of its own class)" in page


# ---- a drill device: its node config names the attack (docs/deployment.md, section 7) ----


def _device_reply(node_config: dict[str, object]) -> Message:
    """One training round of the Byzantine ClientApp on a device with ``node_config``: the real app, its
    signing mod and training; the message as the server sends it."""
    run_config = {"num_clients": 4, "clients_per_round": 4, "num_byzantine": 0, "seed": 3}
    cfg = from_flat(run_config)
    torch.manual_seed(0)  # the same global model for every call
    model = components.build_model(cfg.model, components.dataset_spec(cfg))
    content = RecordDict({
        protocol.ARRAYS: ArrayRecord(model.state_dict()),
        protocol.CONFIG: ConfigRecord({protocol.SERVER_ROUND: 1, protocol.NONCE: "n"}),
    })
    with _server_identity(1):
        message = Message(content, dst_node_id=5, message_type=MessageType.TRAIN)
    context = Context(run_id=1, node_id=5, state=RecordDict(), run_config=run_config,
                      node_config={protocol.PARTITION_ID: 1, protocol.NUM_PARTITIONS: 4, **node_config})
    return byzantine_app.app(message, context)


def _update(reply: Message) -> torch.Tensor:
    assert not reply.has_error(), reply.error.reason
    state = reply.content.array_records[protocol.UPDATE].to_torch_state_dict()
    return torch.cat([t.flatten() for t in state.values()])


def test_a_drill_device_plays_the_user_attack_its_node_config_names_with_its_params(on_path: Path) -> None:
    honest = _update(_device_reply({}))
    for params in ({"attack.params": '{"factor": -3.0}'}, {"attack.params.factor": -3.0}):
        attacked = _update(_device_reply({"attack._target_": f"{MODULE}.ScaledReverse", **params}))
        assert torch.allclose(attacked, -3.0 * honest, atol=1e-6), params
    assert torch.allclose(_update(_device_reply({"attack": "sign_flip"})), -honest, atol=1e-6)
    scaled = _update(_device_reply({"attack.name": "sign_flip", "attack.params.scale": 4.0}))
    assert torch.allclose(scaled, -4.0 * honest, atol=1e-6)


@pytest.mark.parametrize(("node_config", "problem"), [
    ({"attack": "alie"}, r"node config attack 'alie' is omniscient, .* client-side attack: .*sign_flip"),
    ({"attack._target_": f"{MODULE}.AgainstTheMean"}, r"AgainstTheMean' is omniscient"),
    ({"attack": f"{MODULE}.ScaledReverse"}, rf"a user attack goes in attack._target_='{MODULE}.ScaledReverse'"),
    ({"attack._target_": f"{MODULE}.ScaledReverse", "attack.params.factr": -3.0}, r"did you mean 'factor'"),
    ({"attack._target_": f"{MODULE}.ScaledReverse", "attack.params.factor": 3.0}, r"factor must be negative"),
    ({"attack": "sign_flp"}, r"attack 'sign_flp' is unknown \(did you mean 'sign_flip'\?\); a device plays a "
                             r"client-side attack: backdoor, .*, zero, or one of your own by attack._target_$"),
    ({"attack.paramz": "{}"}, r"node config key 'attack.paramz' is unknown \(did you mean 'attack.params'\?\)"),
])
def test_a_drill_device_whose_node_config_names_a_wrong_attack_fails_its_round_with_the_reason(
    on_path: Path, node_config: dict[str, object], problem: str,
) -> None:
    with pytest.raises(ValueError, match=problem):
        _device_reply(node_config)


def test_the_server_of_a_drill_shows_the_reason_a_device_gave_and_the_others_train_on(
    on_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deployment's round loop with four devices, as docs/deployment.md's drill runs them: one plays a
    user attack and says so with its parameters, one names a wrong one; the lines under the round's name
    that device and its reason, and the round goes on."""
    monkeypatch.setattr(client_app, "_warned", set())  # said once a process: not left to an earlier test
    cfg = from_flat({"num_clients": 4, "clients_per_round": 4, "num_byzantine": 1, "num_rounds": 1,
                     "aggregator.name": "median", "seed": 0})
    devices = {11 + i: {protocol.PARTITION_ID: i, protocol.NUM_PARTITIONS: 4} for i in range(4)}
    devices[12] |= {"attack._target_": f"{MODULE}.ScaledReverse", "attack.params.factor": -3.0}
    devices[13] |= {"attack": "alie"}
    rows = run_inprocess(cfg, client_app=make_client_app(cfg, byzantine=True), nodes=devices)
    row = rows[-1]
    [(reason, count)] = row["client_errors"].items()
    assert count == 1 and reason == (
        "ValueError: node config attack 'alie' is omniscient, which only the Hydra simulation runs (it crafts "
        f"from every honest update); a device plays a client-side attack: {', '.join(attacks.client_names())}, "
        "or your own")
    assert row["accepted"] == 3 and row["aggregated"]
    assert row["dropped_nodes"] == [{"node": 13, "partition": 2, "error": reason}]
    assert f"    client error x1 (node 13 (partition 2)): {reason}" in reporting.node_lines(row)
    assert (f"attack '{MODULE}.ScaledReverse' played: this node (partition 1) sends attacked replies, a robustness "
            "drill (ScaledReverse(factor=-3.0))") in caplog.messages
