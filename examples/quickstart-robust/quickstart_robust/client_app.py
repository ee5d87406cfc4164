"""A ClientApp written the Flower way: reply with the local weights and num-examples.

The one line fedrobust adds is the signing mod; without a ``signing-key`` in the node config it
passes replies through unsigned, so the same app runs in simulation and on signed devices.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedrobust import signing_mod
from quickstart_robust.task import Net, load_data
from quickstart_robust.task import test as test_fn
from quickstart_robust.task import train as train_fn

app = ClientApp(mods=[signing_mod()])


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.manual_seed(int(context.node_config["partition-id"]))
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss = train_fn(model, trainloader, int(context.run_config["local-epochs"]), float(context.run_config["lr"]))
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(trainloader.dataset)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, valloader = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss, accuracy = test_fn(model, valloader)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(valloader.dataset)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
