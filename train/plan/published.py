"""Published results the planner is checked against (never fitted to), and the top-1 of each seed
preset's published run (for Valid FLOPS). Sources: docs/seed_systems.md and docs/planner.md.

Each check is a planner command line and the published figures it should reproduce: `time_s`
(time to train) and/or `img_per_s_per_gpu`, with `run`: how the published run was run (hardware,
software, batch), as far as its source says. A check on hardware the planner does not model keeps
its command line: the planner's refusal is the answer.
"""

PUBLISHED_TOP1 = {
    "goyal2017-8k": 0.7626, "akiba2017-32k": 0.749, "jia2018-64k": 0.758, "mikami2018": 0.7503,
    "kumar2019-tpu-32k": 0.763, "yamazaki2019": 0.7598,  # the MLPerf v0.6 run the preset encodes
}

ABCI = ["--gpus-per-node", "4", "--network", "ib-edr", "--links-per-node", "2"]  # 4 V100 + 2 EDR per node

CHECKS = [
    {"system": "Yamazaki et al. 2019 (Fujitsu), 2,048 V100", "time_s": 74.7, "img_per_s_per_gpu": 1.73e6 / 2048,
     "run": "ABCI: 512 nodes x 4 V100-16GB, 2 InfiniBand EDR per node; mixed precision, two-stage all-reduce; "
            "40 per GPU (81,920)",
     "args": ["--preset", "yamazaki2019", "--gpu", "v100", "--gpus", "2048", *ABCI, "--allreduce", "hierarchical"],
     "note": "paper: global batch 81,920 (40/GPU); the preset is the MLPerf v0.6 form, 86,016 (42/GPU), 90 epochs"},
    {"system": "Fujitsu MLPerf v0.6 open, 2,048 V100", "time_s": 1.17 * 60,
     "run": "ABCI: 512 nodes x 4 V100-16GB, 2 EDR per node; fp16, Horovod two-stage all-reduce; 42 per GPU (86,016), "
            "90 epochs",
     "args": ["--preset", "yamazaki2019", "--gpu", "v100", "--gpus", "2048", *ABCI, "--allreduce", "hierarchical"],
     "note": "the run the preset encodes: 90 epochs"},
    {"system": "Mikami et al. 2018 (Sony), 2,176 V100", "time_s": 224.0,
     "run": "ABCI: 544 nodes x 4 V100-16GB, 2 EDR per node; Sony NNL, 2D-torus all-reduce; 16 then 32 per GPU "
            "(34,816 growing to 69,632)",
     "args": ["--preset", "mikami2018", "--gpu", "v100", "--gpus", "2176", *ABCI, "--allreduce", "torus"],
     "note": "epochs and batch switch not published: the preset's 88 epochs, 34,816 then 69,632 after epoch 30"},
    {"system": "NVIDIA MLPerf v4.0, 8 H100", "time_s": 13.27 * 60,
     "run": "one DGX H100 (8 H100-SXM 80GB, NVLink); MXNet, DALI, CUDA graphs; 400 per GPU (3,200)",
     "args": ["--preset", "nvidia-mlperf40-8gpu", "--gpu", "h100", "--gpus", "8"],
     "note": "throughput is a calibration point; checks epochs, evaluation and start-up (preset: 37 epochs)"},
    {"system": "NVIDIA MLPerf v4.0, 8 H200", "time_s": 12.03 * 60,
     "run": "8 H200 141GB in one node; MXNet, DALI, CUDA graphs; 400 per GPU (3,200), 35 epochs",
     "args": ["--preset", "nvidia-mlperf40-8gpu", "--gpu", "h200", "--gpus", "8"],
     "note": "throughput is a calibration point; published 35 epochs, the preset configures 37"},
    {"system": "NVIDIA MLPerf v3.1, 3,584 H100", "time_s": 0.183 * 60,
     "run": "448 DGX H100, 8 InfiniBand NDR per node; MXNet, NCCL with SHARP; 16 per GPU (57,344), 77 epochs",
     "args": ["--preset", "mlperf-bs49152", "--gpu", "h100", "--gpus", "3584", "--per-gpu-batch", "16",
              "--allreduce", "tree"],
     "note": "throughput is a calibration point (run with NCCL trees/SHARP: tree here); published 77 epochs"},
    {"system": "NVIDIA MLPerf v4.0, 2,528 H100", "img_per_s_per_gpu": 2720,
     "run": "Eos: 316 DGX H100 (8 H100-SXM 80GB, 8 InfiniBand NDR 400 Gb/s per node); MXNet 24.04 with Horovod on "
            "NCCL 2.21.5, SHARP network, DALI; 16 per GPU (40,448), 75.9% at epoch 70",
     "args": ["--preset", "nvidia-mlperf40-2528gpu", "--gpu", "h100", "--gpus", "2528", "--gpus-per-node", "8",
              "--network", "ib-ndr", "--links-per-node", "8"],
     "note": "the default flat all-reduce (NCCL's choice); the submission's log gives 6.6-7.3 M img/s per epoch, "
             "about 6.88 M: 2,720 per GPU"},
    {"system": "DeepLearningExamples PyTorch, 8 V100-16GB", "img_per_s_per_gpu": 1040,
     "run": "one DGX-1 (8 V100-16GB, NVLink); PyTorch 21.03 container, AMP; 256 per GPU",
     "args": ["--preset", "mlperf-bs1632", "--gpu", "v100", "--gpus", "8", "--per-gpu-batch", "256"],
     "note": "one DGX-1; the 1-GPU figure (1,200) is the calibration point"},
    {"system": "DeepLearningExamples PyTorch, 8 V100-32GB", "img_per_s_per_gpu": 8056 / 8,
     "run": "8 V100-32GB (DGX-1 class); PyTorch 21.03 container, AMP; 256 per GPU",
     "args": ["--preset", "mlperf-bs1632", "--gpu", "v100", "--gpus", "8", "--per-gpu-batch", "256"],
     "note": "the 32 GB V100, modelled as the 16 GB one"},
    {"system": "DeepLearningExamples PyTorch, 8 A100-80GB", "img_per_s_per_gpu": 2078,
     "run": "one DGX A100 (8 A100-80GB, NVLink); PyTorch 21.03 container, AMP; 256 per GPU",
     "args": ["--preset", "mlperf-bs1632", "--gpu", "a100", "--gpus", "8", "--per-gpu-batch", "256"],
     "note": "one DGX A100; the 1-GPU figure (2,470) is the calibration point"},
    {"system": "NVIDIA MLPerf (MXNet), 8 A100-80GB", "img_per_s_per_gpu": 3400,
     "run": "one DGX A100 (8 A100-80GB); MXNet (NVIDIA's MLPerf code); per-GPU batch not in our sources",
     "args": ["--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "8"],
     "note": "another software stack than the PyTorch calibration point; per-GPU batch not in our sources (408 assumed)"},
    {"system": "Goyal et al. 2017 (Facebook), 256 P100", "time_s": 3600.0,
     "run": "32 servers x 8 P100; Caffe2; 32 per GPU (8,192), 90 epochs",
     "args": ["--preset", "goyal2017-8k", "--gpu", "p100", "--gpus", "256"], "note": "P100 not modelled"},
    {"system": "Akiba et al. 2017 (PFN), 1,024 P100", "time_s": 15 * 60.0,
     "run": "1,024 P100; Chainer (ChainerMN), fp16 all-reduce; 32 per GPU (32,768), 90 epochs",
     "args": ["--preset", "akiba2017-32k", "--gpu", "p100", "--gpus", "1024"], "note": "P100 not modelled"},
    {"system": "Jia et al. 2018 (Tencent), 2,048 P40", "time_s": 6.6 * 60,
     "run": "2,048 P40; fp16 training, LARS, hybrid all-reduce; 32 per GPU (65,536)",
     "args": ["--preset", "jia2018-64k", "--gpu", "p40", "--gpus", "2048"], "note": "P40 not modelled"},
    {"system": "Ying et al. 2018 / Kumar et al. 2019 (Google), 1,024 TPU v3", "time_s": 2.2 * 60,
     "run": "a TPU v3 pod, 1,024 chips; TensorFlow, bfloat16, 2D-torus all-reduce; 32,768 global",
     "args": ["--preset", "kumar2019-tpu-32k", "--gpu", "tpu-v3", "--gpus", "1024"], "note": "TPU not modelled"},
]
