"""The Byzantine ClientApp, for robustness drills: ``fedrobust.clients.byzantine_app:app``.

The same ClientApp as ``fedrobust.clients.client_app:app`` (same training, data, signing),
except that it plays attacks (clients/byzantine.py):

- on a SuperNode whose node config says ``attack=<name>`` (e.g. ``--node-config
  "attack='sign_flip'"``), or ``attack._target_=<your attack>`` with ``attack.params.<name>=...``,
  that node is Byzantine; the other nodes stay honest. A device plays client-side attacks only;
  an omniscient one fails its rounds with the reason;
- with ``attack.name`` (or a client-side attack of your own, ``attack._target_``) set in the run
  config, ``num_byzantine`` partitions drawn from the seed are Byzantine (``flwr run`` simulation
  drills).

It is never the app ``flwr run .`` ships (pyproject.toml names the honest one). A drill names it
as its ClientApp component, e.g. examples/byzantine-drill/pyproject.toml::

    [tool.flwr.app.components]
    serverapp = "fedrobust.strategies.server_app:app"
    clientapp = "fedrobust.clients.byzantine_app:app"
"""

from __future__ import annotations

from fedrobust.clients.client_app import make_client_app

app = make_client_app(byzantine=True)
