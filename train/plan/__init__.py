"""Plan a ResNet-50 training run at any scale: step time, images/s, time to train and Valid FLOPS.

`python -m train.plan [--preset NAME] --gpus N[,M|A:B] --gpu v100|a100|h100|h200 [--gpus-per-node G]
[--network ib-edr|ib-hdr|ib-ndr|eth-100g|custom --link-gbps G --latency-us L] [--links-per-node L] [--allreduce flat|hierarchical|torus|tree]
[--per-gpu-batch B] [--json] [--report FILE]`. The model and where each of its figures comes from:
docs/planner.md. The compute model is fitted to calibration.yaml; published.py holds the results it
is checked against (`--published`).
"""
