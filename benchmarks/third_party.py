"""The third-party corpus: training code nobody on the team wrote, run unmodified under
``ampdoctor record``, diagnosed, and scored against the verdict an expert would give.

Rows (``ROWS`` below): timm's ``train.py`` (fp16 and bf16 AMP, AGC clipping, SGD at LR 1000,
AdamW at LR 5, an fp16 model with no AMP), open_clip's trainer ``python -m
open_clip_train.main`` (AMP fp16 and bf16, clipping with accumulation, LR 1000), nanoGPT's
``train.py`` (a healthy LR, LR 30 unclipped), and in this project's own environment a Hugging
Face Trainer and a Lightning run (``benchmarks/third_party/``: a model and data, built as the
libraries' docs show; the library trains). Each row is recorded with ``python -m ampdoctor
record -o ROW.h5 --force -- PYTHON SCRIPT ARGS`` (default recording options, as a user runs
it), diagnosed with ``python -m ampdoctor diagnose ROW.h5 --format json``, and is right when
the verdict is one the expert accepts (``accept``), as in ``benchmarks/blind_score.py``. The
score: failures named right x/N, healthy runs with no false alarm x/M, and calibration: of the
verdicts given with confidence >= 0.9, how many were right.

    python benchmarks/third_party.py --out benchmarks/results/third_party.json
    python benchmarks/third_party.py --only timm                 # one stack's rows
    python benchmarks/third_party.py --only timm_sgd_lr1000      # one row
    python benchmarks/third_party.py --only litgpt,diffusers_uncond  # stacks and rows
    python benchmarks/third_party.py --workdir /tmp/tp           # keep data, runs and logs
    python benchmarks/third_party.py --show benchmarks/results/third_party.json
    python benchmarks/third_party.py --merge a.json b.json --out all.json  # rows of both

Everything a row needs is built in ``--workdir``, offline: a folder of random 32x32 PNG images
in 4 classes (timm's ImageFolder; open_clip's CSV points at the same files, one caption per
class), the tiny CLIP model config, nanoGPT's dataset (``data/tiny``: a synthetic text encoded
as nanoGPT's ``data/shakespeare_char/prepare.py`` does, ``train.bin``/``val.bin``/``meta.pkl``),
and the third-party scripts, copied from their checkouts. What is not there is said in one
sentence, and that row is "not run: why", never left out.

The checkouts: ``--timm-repo`` (huggingface/pytorch-image-models: its ``train.py`` runs against
the timm the side python has installed) and ``--nanogpt-repo`` (karpathy/nanoGPT: ``train.py``,
``model.py``, ``configurator.py``). Either may be a work tree or a bare git directory (its HEAD
is read with ``git show``). Results name the commit.

The side python (``--side-python``) runs timm and open_clip, which need torchvision: PyPI's
torchvision does not import beside this project's torch 2.13.0 CPU build ("operator
torchvision::nms does not exist"), so they get a venv of their own. Made so (Python 3.11,
x86_64; about 6 GB, a CUDA build of torch whose CUDA libraries are ordinary pip wheels, which
load without a GPU: no stub library and no LD_LIBRARY_PATH are needed; about 70 s here, where
pip takes torch and torchvision from the local wheel index):

    python3.11 -m venv /tmp/tv
    /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 timm==1.0.31 \\
        open-clip-torch==3.3.0 pandas webdataset h5py matplotlib click

(pandas and webdataset are open_clip_train's imports; h5py, matplotlib and click are
ampdoctor's, which the side python imports from this checkout through PYTHONPATH.) The Hugging
Face and Lightning rows, nanoGPT and ``ampdoctor diagnose`` run with the python that runs this
script (``pip install torch==2.13.0 -e '.[test]'``).

The LLM and diffusion trainers (issue 40; ``third_party_trainers.py`` builds what they need):
``litgpt pretrain`` (a 2-layer GPT-NeoX from a config file, ``TextFiles`` data, bf16-mixed and
bf16-true), ``litgpt finetune_full`` (a tiny random checkpoint saved with litgpt's own ``GPT``,
``JSON`` instruction data; ``litgpt finetune_lora`` on the same with its default adapters),
diffusers' ``train_unconditional.py`` (``--diffusers-repo``; bf16,
a tiny UNet config, a folder of 16 px images), its ``train_text_to_image.py`` (under
``accelerate launch --mixed_precision bf16`` as its README shows; a tiny random Stable Diffusion
folder saved with diffusers' own pipeline, 16 px images with a captions column) and torchtune's
``tune run
full_finetune_single_device`` (a tiny random Llama-2 saved from torchtune's own builder, a
SentencePiece tokenizer, ``text_completion_dataset``, on CPU) and transformers'
``examples/pytorch/language-modeling/run_clm_no_trainer.py`` (``--transformers-repo``; an
accelerate loop run with ``accelerate launch --mixed_precision bf16``, a 2-layer GPT-2 trained
from a config and a byte-level BPE tokenizer, both local, and a text file). A failing row with ``dose`` is recorded
again with the ``--apply`` its diagnosis prescribes (``RUN.treated.h5``): the table's "dosed"
lines give the treated run's verdict, its loss over its last five steps beside the failing and
the healthy row's, and what ``ampdoctor compare`` calls failing -> treated and healthy ->
treated. litgpt and torchtune run in a venv of their own (``--tp-python``: Python 3.11, the
CPU torch of the local wheel index, which the pin selects; torchtune 0.6.1, the last release,
imports ``torchao.dtypes.nf4tensor``, which torchao 0.18 no longer has, and torchao 0.12
does not import beside torch 2.13, hence 0.15.0):

    python3.11 -m venv /work/venv-tp
    /work/venv-tp/bin/pip install torch==2.13.0 litgpt litdata torchtune torchao==0.15.0 \\
        'jsonargparse[signatures]' h5py matplotlib click numpy

diffusers' script and ``run_clm_no_trainer.py`` import torchvision and transformers, which do
not import beside that CPU torch, so they run in a third venv (``--tv-python``) with PyPI's
torch build (``--isolated``: past this machine's wheel index and constraints):

    python3.11 -m venv /work/venv-tv
    /work/venv-tv/bin/pip install --isolated torch==2.13.0 torchvision diffusers datasets \\
        accelerate==1.16.0 tensorboard transformers h5py matplotlib click numpy

``run_clm_no_trainer.py`` is in no package (transformers' wheel and sdist hold ``src/`` only)
and transformers' repository is over the size a snapshot may have here: ``--transformers-repo``
is a checkout, or a folder that holds the file at its repository path with a ``SOURCE`` file
naming where it was taken from (the default, ``/work/third_party/transformers``, holds the
script as upstream has it at ``check_min_version("4.57.0.dev0")``, unmodified; results name
that line).

Every row runs with ``HF_HUB_OFFLINE=1``: its data and models are in the workdir.

Training processes run one at a time with ``OMP_NUM_THREADS=1`` (``--threads``). Run from the
repository root so that its ``ampdoctor`` is the one imported.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import blind_score  # noqa: E402 - the scoring both corpora share
import third_party_trainers as trainers  # noqa: E402 - what the LLM and diffusion rows need

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "benchmarks", "third_party")
TIMM_REPO = "/work/.mirror/huggingface+pytorch-image-models/repo"
NANOGPT_REPO = "/work/.mirror/karpathy+nanoGPT/repo"
SIDE_PYTHON = "/tmp/tv/bin/python"
TP_PYTHON = "/work/venv-tp/bin/python"
TV_PYTHON = "/work/venv-tv/bin/python"
DIFFUSERS_REPO = "/work/.mirror/huggingface+diffusers/repo"
# run_clm_no_trainer.py is in no package: a checkout of huggingface/transformers, or a folder
# holding the file at its repository path (with a SOURCE file naming where it came from)
TRANSFORMERS_REPO = "/work/third_party/transformers"
CLM_SCRIPT = "examples/pytorch/language-modeling/run_clm_no_trainer.py"

TIMM = ["--data-dir", "{images}", "--model", "test_resnet", "--img-size", "32",
        "--num-classes", "4", "--device", "cpu", "--workers", "0", "--no-prefetcher",
        "--log-interval", "5", "-b", "16", "--output", "{work}/out"]
CLIP = ["--train-data", "{work}/train.csv", "--dataset-type", "csv", "--csv-img-key",
        "filepath", "--csv-caption-key", "title", "--model", "local-dir:{work}/cfg",
        "--device", "cpu", "--batch-size", "16", "--workers", "0", "--warmup", "2",
        "--report-to", "none", "--logs", "{work}/logs", "--name", "{row}",
        "--save-frequency", "0", "--log-every-n-steps", "2"]
NANO = ["--dataset=tiny", "--device=cpu", "--dtype=float32", "--compile=False", "--n_layer=2",
        "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=8", "--max_iters=40",
        "--eval_interval=1000", "--eval_iters=2", "--log_interval=1", "--warmup_iters=5",
        "--lr_decay_iters=40", "--always_save_checkpoint=False", "--out_dir={work}/out"]


def row(name: str, stack: str, args: list[str], expected: str, accept: list[str],
        why: str, record: Optional[list[str]] = None, dose: Optional[str] = None,
        env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """One row; ``dose`` names the healthy row that the prescribed fix, recorded again on this
    row's command with ``--apply``, is compared with (``third_party_trainers.dose``); ``env``
    is set in the training's environment."""
    return {"name": name, "stack": stack, "args": args, "expected": expected,
            "accept": accept, "why": why, "record": record or [], "dose": dose,
            "env": env or {}}


# The expert's verdict, and why, for each row. On CPU timm and nanoGPT use no GradScaler (timm
# makes one for CUDA fp16 only; nanoGPT's is torch.cuda.amp's, off without CUDA) and nanoGPT
# runs no autocast (its ctx is a nullcontext on CPU, whatever --dtype says): its rows are fp32.
ROWS = [
    row("timm_fp16", "timm", TIMM + ["--amp", "--amp-dtype", "float16", "--epochs", "3",
                                     "--lr", "0.05", "--opt", "sgd"],
        "healthy", ["healthy"], "fp16 autocast, SGD at a sane LR: the loss falls"),
    row("timm_bf16", "timm", TIMM + ["--amp", "--amp-dtype", "bfloat16", "--epochs", "3",
                                     "--lr", "0.05", "--opt", "sgd"],
        "healthy", ["healthy"], "bf16 autocast, SGD at a sane LR: the loss falls"),
    row("timm_agc", "timm", TIMM + ["--amp", "--amp-dtype", "float16", "--epochs", "2",
                                    "--lr", "0.05", "--opt", "sgd", "--clip-grad", "0.01",
                                    "--clip-mode", "agc"],
        "healthy", ["healthy"], "adaptive gradient clipping (timm's own) on a healthy run"),
    row("timm_sgd_lr1000", "timm", TIMM + ["--amp", "--amp-dtype", "float16", "--epochs", "2",
                                           "--lr", "1000", "--opt", "sgd"],
        "lr_overflow", ["lr_overflow"],
        "timm warms up at 1e-5 for the first epoch, then steps SGD at LR 200: the weights blow "
        "up and the fp16 forward overflows"),
    row("timm_adamw_lr5", "timm", TIMM + ["--amp", "--amp-dtype", "float16", "--epochs", "2",
                                          "--lr", "5", "--opt", "adamw"],
        "lr_overflow", ["lr_overflow", "diverged"],
        "AdamW at LR 1 after warm-up: the loss blows up, to an overflow or not"),
    row("timm_model_fp16", "timm", TIMM + ["--model-dtype", "float16", "--epochs", "3",
                                           "--lr", "0.05", "--opt", "sgd"],
        "grad_underflow", ["grad_underflow", "lost_updates"],
        "fp16 weights, no autocast, no loss scaling, no fp32 master weights (timm warns "
        "'float16 is not recommended for training'): from step 6 on a third of the sampled "
        "gradient elements are subnormal or 0, deep convs' 96-99%, and the warm-up epoch's "
        "updates (LR 1e-5) round away; the loss still falls like timm_fp16's in 36 steps"),
    row("timm_model_fp16_every3", "timm", TIMM + ["--model-dtype", "float16", "--epochs", "3",
                                                  "--lr", "0.05", "--opt", "sgd"],
        "grad_underflow", ["grad_underflow", "lost_updates"],
        "the row above recorded with --every 3 (not a user's default): whether the verdict "
        "follows once the sampled tier sees the steps after the first", record=["--every", "3"]),
    row("clip_amp", "open_clip", CLIP + ["--precision", "amp", "--epochs", "3", "--lr", "1e-3"],
        "healthy", ["healthy"], "fp16 autocast with open_clip's GradScaler"),
    row("clip_amp_bf16", "open_clip", CLIP + ["--precision", "amp_bf16", "--epochs", "3",
                                              "--lr", "1e-3"],
        "healthy", ["healthy"], "bf16 autocast"),
    row("clip_clip_accum", "open_clip", CLIP + ["--precision", "amp", "--epochs", "3",
                                                "--lr", "1e-3", "--grad-clip-norm", "1",
                                                "--accum-freq", "2"],
        "healthy", ["healthy"], "open_clip's feature-caching accumulation and norm clipping"),
    row("clip_lr1000", "open_clip", CLIP + ["--precision", "amp", "--epochs", "2",
                                            "--lr", "1000"],
        "lr_overflow", ["lr_overflow"], "AdamW at LR 1000: overflow from the first steps"),
    row("nanogpt_lr1e-3", "nanogpt", NANO + ["--learning_rate=1e-3"],
        "healthy", ["healthy"], "the LR of nanoGPT's own shakespeare_char config"),
    row("nanogpt_lr30", "nanogpt", NANO + ["--learning_rate=30.0", "--grad_clip=0.0"],
        "lr_overflow", ["lr_overflow"], "AdamW at LR 30 with clipping off: the loss goes NaN"),
    row("hf_trainer_bf16", "hf_trainer", ["--bf16", "--steps", "60"],
        "healthy", ["healthy"], "Trainer with bf16=True (accelerate's autocast), a tiny GPT-2"),
    row("lightning_bf16", "lightning", ["--precision", "bf16-mixed", "--epochs", "3"],
        "healthy", ["healthy"], "Trainer(precision='bf16-mixed'), an MLP classifier"),
]

# The LLM and diffusion trainers (issue 40), each configured only by its own flags and config
# files (built by third_party_trainers.py). litgpt's LR schedule warms up over 4 steps to the
# LR given, then decays (cosine) to 1e-4; it clips at max_norm 1 (its pretrain default).
def pretrain(lr: float) -> list[str]:
    """``litgpt pretrain`` with the config file of AdamW at ``lr``
    (``third_party_trainers.pretrain_config``)."""
    return ["pretrain", "--config", f"{{work}}/pretrain_lr{lr:g}.yaml", "--out_dir",
            "{work}/out/{row}"]


# litgpt pretrain always wraps the model in torch.compile; inductor's C++ build of a model's
# forward and backward takes minutes on a CPU, so its rows run with dynamo off (an environment
# variable, as a user on a CPU would set it; no line of litgpt changed)
EAGER = {"TORCHDYNAMO_DISABLE": "1"}


def adamw(lr: float) -> str:
    """litgpt finetune_full's ``--optimizer`` as a whole (its ``--optimizer.lr`` adds a key
    that the optimizer never reads): AdamW at ``lr``."""
    text = json.dumps({"class_path": "torch.optim.AdamW",
                       "init_args": {"lr": lr, "weight_decay": 0.1, "betas": [0.9, 0.95]}})
    return text.replace("{", "{{").replace("}", "}}")  # a row's args are format strings
LITGPT_FT = ["finetune_full", "{work}/checkpoint", "--data", "JSON", "--data.json_path",
             "{data}", "--data.val_split_fraction", "0.05", "--out_dir", "{work}/out/{row}",
             "--train.global_batch_size", "8", "--train.micro_batch_size", "8",
             "--train.max_steps", "30", "--train.save_interval", "100000",
             "--train.log_interval", "1", "--train.lr_warmup_steps", "2",
             "--train.max_seq_length", "48", "--eval.interval", "100000",
             "--eval.initial_validation", "false", "--eval.final_validation", "false",
             "--logger_name", "csv", "--devices", "1"]
UNCOND = ["--train_data_dir", "{work}/images/train", "--model_config_name_or_path",
          "{work}/unet", "--resolution", "16", "--train_batch_size", "8", "--num_epochs", "4",
          "--lr_warmup_steps", "4", "--output_dir", "{work}/out/{row}", "--logging_dir",
          "{work}/logs", "--save_images_epochs", "1000", "--save_model_epochs", "1000",
          "--eval_batch_size", "1", "--ddpm_num_inference_steps", "2",
          "--checkpointing_steps", "100000", "--dataloader_num_workers", "0"]
ROWS += [
    row("litgpt_pretrain", "litgpt", pretrain(3e-3) + ["--precision", "bf16-mixed"],
        "healthy", ["healthy"], "litgpt pretrain, a 2-layer GPT-NeoX from a config file, "
        "TextFiles data, bf16-mixed, the config's AdamW at 3e-3 clipped at 1: the loss falls "
        "(6.19 to 3.5 in 40 steps, litgpt's own log)", env=EAGER),
    row("litgpt_pretrain_lr10", "litgpt", pretrain(10) + ["--precision", "bf16-mixed"],
        "lr_overflow", ["lr_overflow", "diverged"],
        "AdamW at LR 10 after a 4-step warm-up: every step moves each weight by up to 10 "
        "whatever the clip; the loss blows up, to an overflow or not", dose="litgpt_pretrain",
        env=EAGER),
    row("litgpt_pretrain_bf16_true", "litgpt", pretrain(3e-5) + ["--precision", "bf16-true"],
        "lost_updates", ["lost_updates"],
        "bf16-true: bf16 weights and no fp32 master copy; AdamW steps of about 3e-5 are under "
        "half an ulp of every weight above 0.008 in magnitude (the LayerNorm gains at 1 need "
        "4e-3): most updates round away", env=EAGER),
]
ROWS += [
    row("litgpt_finetune", "litgpt_ft", LITGPT_FT + ["--precision", "bf16-mixed",
                                                    "--optimizer", adamw(1e-3)],
        "healthy", ["healthy"], "litgpt finetune_full from a tiny random checkpoint saved with "
        "litgpt's GPT, JSON instruction data, bf16-mixed, AdamW at 1e-3", env=EAGER),
    row("litgpt_finetune_lr10", "litgpt_ft", LITGPT_FT + ["--precision", "bf16-mixed",
                                                         "--optimizer", adamw(10)],
        "lr_overflow", ["lr_overflow", "diverged"],
        "AdamW at LR 10 after a 2-step warm-up: the loss blows up", dose="litgpt_finetune",
        env=EAGER),
    row("litgpt_finetune_bf16_true", "litgpt_ft", LITGPT_FT + ["--precision", "bf16-true",
                                                              "--optimizer", adamw(3e-5)],
        "lost_updates", ["lost_updates"],
        "bf16-true at AdamW 3e-5: as litgpt_pretrain_bf16_true, most updates round away",
        env=EAGER),
]
# litgpt finetune_lora on the same checkpoint and data, with its default adapters (rank 8,
# alpha 16, dropout 0.05, on the query and value weights: 4,096 trainable parameters beside
# 149,248 frozen ones). Run plainly first (litgpt's own log): at LR 10 the loss spikes (5.90
# to 6.51 at step 4, 5.12 to 6.15 at step 15) but ends at 4.73, below the healthy run's, so
# the LR row is LR 100; and bf16-true is no precision failure here: its adapters' B starts at
# 0 and A's steps at LR 1e-2 are above half an ulp of A, and its loss follows bf16-mixed's
# to the third decimal (at 3e-5 neither precision's loss moves in 30 steps: 6.076 to 6.075)
LITGPT_LORA = ["finetune_lora", *LITGPT_FT[1:]]
ROWS += [
    row("litgpt_lora", "litgpt_lora", LITGPT_LORA + ["--precision", "bf16-mixed",
                                                    "--optimizer", adamw(1e-2)],
        "healthy", ["healthy"], "litgpt finetune_lora (rank-8 adapters on the query and value "
        "weights of the frozen tiny checkpoint), bf16-mixed, AdamW at 1e-2: the loss falls "
        "(6.08 to 4.97 in 30 steps, litgpt's own log, run without ampdoctor)", env=EAGER),
    row("litgpt_lora_lr100", "litgpt_lora", LITGPT_LORA + ["--precision", "bf16-mixed",
                                                          "--optimizer", adamw(100)],
        "lr_overflow", ["lr_overflow", "diverged"],
        "AdamW at LR 100 after a 2-step warm-up: the loss rises (6.08 to 6.75 by step 5) and "
        "is NaN from step 6 on (run without ampdoctor)", dose="litgpt_lora", env=EAGER),
    row("litgpt_lora_bf16_true", "litgpt_lora", LITGPT_LORA + ["--precision", "bf16-true",
                                                              "--optimizer", adamw(1e-2)],
        "healthy", ["healthy"],
        "bf16-true (bf16 adapters and base, no fp32 copy) at AdamW 1e-2: the adapters' B "
        "starts at 0, and A's steps (|A| <= 1/8) stay above half an ulp until the cosine "
        "decay's last steps; the loss follows litgpt_lora's (6.08 to 4.97, within 0.002 at "
        "every step, run without ampdoctor)", env=EAGER),
]
ROWS += [
    row("diffusers_uncond", "diffusers", UNCOND + ["--mixed_precision", "bf16",
                                                  "--learning_rate", "1e-3"],
        "healthy", ["healthy"], "train_unconditional.py with bf16 (accelerate's autocast, "
        "the batch in bf16), a 2-resolution UNet2DModel, AdamW at 1e-3, clipped at 1: the "
        "noise-prediction loss falls from about 1"),
    row("diffusers_uncond_lr10", "diffusers", UNCOND + ["--mixed_precision", "bf16",
                                                       "--learning_rate", "10"],
        "lr_overflow", ["lr_overflow", "diverged"],
        "AdamW at LR 10 (after 4 warm-up steps): the clip bounds the gradient, not Adam's "
        "step; the weights and activations blow up", dose="diffusers_uncond"),
]
# diffusers' train_text_to_image.py, launched as its README shows (accelerate launch
# --mixed_precision, --use_ema, --center_crop, --random_flip, gradient accumulation, a
# constant LR with no warm-up, --max_grad_norm 1) on a tiny random Stable Diffusion folder
# (third_party_trainers.text_to_image); the README's batch 1 x 4 is 4 x 2 here. Under bf16 it
# casts the frozen VAE and text encoder to bf16 and trains the fp32 UNet under accelerate's
# autocast. No precision failure of its own trains on CPU: --mixed_precision fp16 casts the
# VAE and text encoder to fp16, accelerate gives no fp16 autocast on a CPU, and the first
# forward stops ("mat1 and mat2 must have the same dtype, but got Half and Float"); a UNet
# saved in bf16 is loaded back in fp32 by from_pretrained (no torch_dtype), and the script
# passes no --variant to the UNet's load
T2I = ["--pretrained_model_name_or_path", "{work}/model", "--train_data_dir",
       "{work}/images/train", "--image_column", "image", "--caption_column", "text",
       "--use_ema", "--resolution", "16", "--center_crop", "--random_flip",
       "--train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_train_steps",
       "40", "--max_grad_norm", "1", "--lr_scheduler", "constant", "--lr_warmup_steps", "0",
       "--dataloader_num_workers", "0", "--checkpointing_steps", "100000", "--seed", "0",
       "--output_dir", "{work}/out/{row}"]


def t2i(precision: str) -> list[str]:
    """``accelerate launch --mixed_precision PRECISION train_text_to_image.py`` with ``T2I``."""
    return ["--mixed_precision", precision, "train_text_to_image.py", *T2I]


ROWS += [
    row("diffusers_t2i", "diffusers_t2i", t2i("bf16") + ["--learning_rate", "1e-3"],
        "healthy", ["healthy"], "train_text_to_image.py under accelerate launch "
        "--mixed_precision bf16 (the UNet fp32 under accelerate's autocast, the frozen VAE and "
        "text encoder in bf16), EMA, AdamW at 1e-3 constant, clipped at 1: the "
        "noise-prediction loss falls (1.04 to about 0.4 in 40 steps, the script's own "
        "step_loss, run without ampdoctor)"),
    row("diffusers_t2i_lr10", "diffusers_t2i", t2i("bf16") + ["--learning_rate", "10"],
        "lr_overflow", ["lr_overflow", "diverged"],
        "AdamW at LR 10 from the first step (constant, no warm-up): the clip bounds the "
        "gradient, not Adam's step, so every weight moves by up to 10; the loss goes 1.04 to "
        "2e5 on step 1 and NaN from step 2 (run without ampdoctor)", dose="diffusers_t2i"),
]
# torchtune's full finetune recipe on a tiny random Llama (fp32 and its default bf16, which
# keeps bf16 weights), and transformers' run_clm_no_trainer.py (an accelerate loop, a GPT-2
# trained from a config), launched as its README says (``accelerate launch``) with accelerate's
# own --mixed_precision; it clips nothing and steps a linear schedule with no warm-up
TUNE = ["full_finetune_single_device", "--config", "{work}/tune.yaml"]


def clm(precision: str, config: str = "gpt2") -> list[str]:
    """``accelerate launch --mixed_precision PRECISION run_clm_no_trainer.py`` on the local
    text file, the GPT-2 config and tokenizer ``{work}/CONFIG`` (built by
    ``third_party_trainers.clm``), 40 steps of 8 x 32 tokens."""
    return ["--mixed_precision", precision, "run_clm_no_trainer.py",
            "--train_file", "{work}/train.txt", "--config_name", f"{{work}}/{config}",
            "--tokenizer_name", f"{{work}}/{config}", "--block_size", "32",
            "--per_device_train_batch_size", "8", "--max_train_steps", "40", "--seed", "0",
            "--output_dir", "{work}/out/{row}"]


ROWS += [
    row("torchtune_full_fp32", "torchtune", TUNE + ["dtype=fp32", "optimizer.lr=1e-3"],
        "healthy", ["healthy"], "the full finetune recipe in fp32, AdamW at 1e-3"),
    row("torchtune_full_lr10", "torchtune", TUNE + ["dtype=fp32", "optimizer.lr=10"],
        "diverged", ["diverged", "lr_overflow"], "AdamW at LR 10: the loss blows up"),
    row("torchtune_full_bf16_lr3e-5", "torchtune", TUNE + ["dtype=bf16", "optimizer.lr=3e-5"],
        "lost_updates", ["lost_updates"],
        "the recipe's dtype=bf16 keeps bf16 weights with no fp32 copy: AdamW steps of 3e-5 "
        "round away"),
    row("accelerate_clm", "accelerate", clm("bf16") + ["--learning_rate", "1e-3"],
        "healthy", ["healthy"], "run_clm_no_trainer.py under accelerate launch --mixed_precision "
        "bf16 (accelerate's autocast), a 2-layer GPT-2 from a config, AdamW at 1e-3 decaying "
        "linearly: the loss falls from ln 384 = 5.95"),
    row("accelerate_clm_lr10", "accelerate", clm("bf16") + ["--learning_rate", "10"],
        "diverged", ["diverged", "lr_overflow"],
        "AdamW at LR 10 from the first step (no warm-up), unclipped: every weight moves by up "
        "to 10 on step 0; the loss blows up, to an overflow or not", dose="accelerate_clm"),
    row("accelerate_clm_bf16_weights", "accelerate", clm("bf16", "gpt2_bf16"),
        "lost_updates", ["lost_updates"],
        "the config's \"dtype\": \"bfloat16\" builds bf16 weights, which the script's torch "
        "AdamW steps with no fp32 copy, at the script's default LR 5e-5: under half an ulp of "
        "every weight above 0.013 in magnitude (the LayerNorm gains at 1 need 4e-3); most "
        "updates round away"),
]
STACKS = ["timm", "open_clip", "nanogpt", "hf_trainer", "lightning", "litgpt", "litgpt_ft",
          "litgpt_lora", "diffusers", "diffusers_t2i", "torchtune", "accelerate"]
COLORS = [("red", (200, 40, 40)), ("green", (40, 200, 40)), ("blue", (40, 40, 200)),
          ("gray", (128, 128, 128))]


# ---------------------------------------------------------------------------------------------
# building what the rows need


NotRun = trainers.NotRun


def png(path: str, size: int, rgb: bytes) -> None:
    """An 8-bit RGB PNG written with the standard library (no PIL in this python)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    rows = b"".join(b"\0" + rgb[y * size * 3:(y + 1) * size * 3] for y in range(size))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2,
                                                                  0, 0, 0))
                + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def make_images(folder: str, per_class: int = 48, val_per_class: int = 8,
                size: int = 32) -> str:
    """``train/`` and ``validation/`` ImageFolders of noisy images, one colour per class."""
    done = os.path.join(folder, ".done")
    if os.path.exists(done):
        return folder
    rng = random.Random(0)
    for split, n in (("train", per_class), ("validation", val_per_class)):
        for c, (_, base) in enumerate(COLORS):
            d = os.path.join(folder, split, f"class{c}")
            os.makedirs(d, exist_ok=True)
            for i in range(n):
                noise = rng.randbytes(size * size * 3)
                rgb = bytes((base[k % 3] * 3 + noise[k] * 2) // 5 for k in range(len(noise)))
                png(os.path.join(d, f"{i}.png"), size, rgb)
    open(done, "w").close()
    return folder


def repo_file(repo: str, path: str, dest: str) -> None:
    """``path`` of a checkout, or of a bare git directory's HEAD, copied to ``dest``."""
    if os.path.isfile(os.path.join(repo, path)):
        shutil.copyfile(os.path.join(repo, path), dest)
        return
    done = subprocess.run(["git", "--git-dir", repo, "show", f"HEAD:{path}"],
                          capture_output=True)
    if done.returncode != 0:
        raise NotRun(f"{repo} has no {path} (neither a work tree nor a git directory with it)")
    with open(dest, "wb") as f:
        f.write(done.stdout)


def repo_commit(repo: str) -> Optional[str]:
    for flag in (["-C", repo], ["--git-dir", repo]):
        done = subprocess.run(["git", *flag, "rev-parse", "HEAD"], capture_output=True,
                              text=True)
        if done.returncode == 0:
            return done.stdout.strip()
    return None


def need_repo(repo: str, what: str, flag: str) -> None:
    if not os.path.isdir(repo):
        raise NotRun(f"no {what} checkout at {repo} (pass {flag})")


def check_python(python: str, modules: list[str], how: str) -> str:
    """The python's versions line, or NotRun naming the first module it cannot import."""
    if not os.path.exists(python):
        raise NotRun(f"no python at {python} ({how})")
    code = ("import importlib, sys, torch\n"
            f"for m in {modules!r}:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except Exception as e:\n        sys.exit(f'{m}: {type(e).__name__}: {e}')\n"
            "print(' '.join(f'{m} {getattr(sys.modules[m], \"__version__\", \"\")}'.strip()\n"
            f"               for m in {['torch'] + modules!r} if '.' not in m))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True,
                          env=child_env(1), timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise NotRun(f"{python} cannot import {last[:200]} ({how})")
    return done.stdout.strip()


class Setup:
    """Builds each stack's folder in the workdir once, and remembers what failed and why."""

    def __init__(self, args: argparse.Namespace, workdir: str):
        self.args, self.workdir = args, workdir
        self.done: dict[str, Any] = {}
        self.info: dict[str, Any] = {}

    def get(self, stack: str) -> dict[str, Any]:
        if stack not in self.done:
            try:
                self.done[stack] = getattr(self, stack)()
            except NotRun as e:
                self.done[stack] = e
        if isinstance(self.done[stack], NotRun):
            raise self.done[stack]
        return self.done[stack]

    def side(self) -> str:
        if "side" not in self.info:
            try:
                self.info["side"] = check_python(
                    self.args.side_python, ["torchvision", "timm", "open_clip", "open_clip_train.main",
                                            "h5py", "click", "matplotlib"],
                    "make the side venv as benchmarks/third_party.py's docstring says, or pass "
                    "--side-python")
            except NotRun as e:
                self.info["side"] = e
        if isinstance(self.info["side"], NotRun):
            raise self.info["side"]
        return self.args.side_python

    def timm(self) -> dict[str, Any]:
        need_repo(self.args.timm_repo, "pytorch-image-models", "--timm-repo")
        python = self.side()
        work = os.path.join(self.workdir, "timm")
        os.makedirs(work, exist_ok=True)
        repo_file(self.args.timm_repo, "train.py", os.path.join(work, "train.py"))
        self.info["timm_commit"] = repo_commit(self.args.timm_repo)
        images = make_images(os.path.join(self.workdir, "images"))
        return {"python": python, "cwd": work, "command": [python, "train.py"],
                "fill": {"work": work, "images": images}}

    def open_clip(self) -> dict[str, Any]:
        python = self.side()
        work = os.path.join(self.workdir, "open_clip")
        os.makedirs(os.path.join(work, "cfg"), exist_ok=True)
        images = make_images(os.path.join(self.workdir, "images"))
        with open(os.path.join(work, "train.csv"), "w") as f:
            f.write("filepath\ttitle\n")
            for c, (color, _) in enumerate(COLORS):
                d = os.path.join(images, "train", f"class{c}")
                for name in sorted(os.listdir(d), key=lambda n: int(n.split(".")[0])):
                    f.write(f"{os.path.join(d, name)}\ta photo of {color} noise\n")
        config = {"model_cfg": {
            "embed_dim": 32,
            "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8,
                           "head_width": 16},
            "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2,
                         "layers": 2}}}
        with open(os.path.join(work, "cfg", "open_clip_config.json"), "w") as f:
            json.dump(config, f, indent=1)
        return {"python": python, "cwd": work,
                "command": [python, "-m", "open_clip_train.main"], "fill": {"work": work},
                "before": lambda name: shutil.rmtree(os.path.join(work, "logs", name),
                                                     ignore_errors=True)}

    def nanogpt(self) -> dict[str, Any]:
        need_repo(self.args.nanogpt_repo, "nanoGPT", "--nanogpt-repo")
        check_python(sys.executable, ["numpy"], "pip install numpy")
        work = os.path.join(self.workdir, "nanogpt")
        os.makedirs(os.path.join(work, "data", "tiny"), exist_ok=True)
        for name in ("train.py", "model.py", "configurator.py"):
            repo_file(self.args.nanogpt_repo, name, os.path.join(work, name))
        self.info["nanogpt_commit"] = repo_commit(self.args.nanogpt_repo)
        tiny_text_dataset(os.path.join(work, "data", "tiny"))
        return {"python": sys.executable, "cwd": work, "command": [sys.executable, "train.py"],
                "fill": {"work": work}}

    def hf_trainer(self) -> dict[str, Any]:
        check_python(sys.executable, ["transformers", "accelerate"],
                     "pip install torch==2.13.0 -e '.[test]'")
        return {"python": sys.executable, "cwd": self.workdir,
                "command": [sys.executable, os.path.join(HERE, "hf_trainer.py")], "fill": {}}

    def lightning(self) -> dict[str, Any]:
        check_python(sys.executable, ["lightning"], "pip install torch==2.13.0 -e '.[test]'")
        return {"python": sys.executable, "cwd": self.workdir,
                "command": [sys.executable, os.path.join(HERE, "lightning_train.py")],
                "fill": {}}


    def venv(self, key: str, python: str, modules: list[str], flag: str) -> str:
        """``python`` if it imports ``modules`` (checked once), else NotRun."""
        if key not in self.info:
            try:
                self.info[key] = check_python(
                    python, modules + ["h5py", "click", "matplotlib"],
                    "make its venv as benchmarks/third_party.py's docstring says, or pass "
                    + flag)
            except NotRun as e:
                self.info[key] = e
        if isinstance(self.info[key], NotRun):
            raise self.info[key]
        return python

    def tp(self) -> str:
        """The python of litgpt and torchtune (``--tp-python``)."""
        return self.venv("tp", self.args.tp_python, ["litgpt", "litdata", "tokenizers"],
                         "--tp-python")

    def tv(self) -> str:
        """The python of diffusers and the accelerate script (``--tv-python``)."""
        return self.venv("tv", self.args.tv_python, ["torchvision", "diffusers", "accelerate",
                                                     "datasets", "tensorboard"],
                         "--tv-python")

    def litgpt(self) -> dict[str, Any]:
        python = self.tp()
        work = trainers.litgpt(os.path.join(self.workdir, "litgpt"), python, child_env(1))
        return {"python": python, "cwd": work, "command": [python, "-m", "litgpt"],
                "fill": {"work": work}}

    def litgpt_ft(self) -> dict[str, Any]:
        stack = self.litgpt()
        data = trainers.finetune_data(os.path.join(self.workdir, "litgpt_ft"))
        return {**stack, "fill": {**stack["fill"], "data": os.path.join(data, "train.json")}}

    def litgpt_lora(self) -> dict[str, Any]:
        """finetune_lora's rows: ``litgpt_ft``'s checkpoint and data."""
        return self.litgpt_ft()

    def diffusers(self) -> dict[str, Any]:
        python = self.tv()
        work = trainers.diffusers(os.path.join(self.workdir, "diffusers"), make_images)
        repo_file(self.args.diffusers_repo,
                  "examples/unconditional_image_generation/train_unconditional.py",
                  os.path.join(work, "train_unconditional.py"))
        self.info["diffusers_commit"] = repo_commit(self.args.diffusers_repo)
        return {"python": python, "cwd": work, "command": [python, "train_unconditional.py"],
                "fill": {"work": work}}


    def diffusers_t2i(self) -> dict[str, Any]:
        python = self.tv()
        check_python(python, ["transformers", "tokenizers"], "pip install transformers")
        work = trainers.text_to_image(os.path.join(self.workdir, "diffusers_t2i"), python,
                                      child_env(1), make_images,
                                      [color for color, _ in COLORS])
        repo_file(self.args.diffusers_repo, "examples/text_to_image/train_text_to_image.py",
                  os.path.join(work, "train_text_to_image.py"))
        self.info["diffusers_commit"] = repo_commit(self.args.diffusers_repo)
        return {"python": python, "cwd": work, "command": accelerate_launch(python),
                "fill": {"work": work}}

    def torchtune(self) -> dict[str, Any]:
        python = self.tp()
        check_python(python, ["torchtune", "torchtune.training", "sentencepiece"],
                     "pip install torchtune 'torchao==0.15.0' (torchtune 0.6.1 imports "
                     "torchao.dtypes.nf4tensor, which later torchao removed)")
        work = trainers.torchtune(os.path.join(self.workdir, "torchtune"), python, child_env(1))
        return {"python": python, "cwd": work,
                "command": [os.path.join(os.path.dirname(python), "tune"), "run"],
                "fill": {"work": work}}

    def accelerate(self) -> dict[str, Any]:
        python = self.tv()
        check_python(python, ["transformers", "tokenizers"], "pip install transformers")
        work = trainers.clm(os.path.join(self.workdir, "accelerate"))
        repo_file(self.args.transformers_repo, CLM_SCRIPT,
                  os.path.join(work, "run_clm_no_trainer.py"))
        self.info["transformers_commit"] = repo_commit(self.args.transformers_repo) or \
            source_note(self.args.transformers_repo)
        return {"python": python, "cwd": work, "command": accelerate_launch(python),
                "fill": {"work": work}}


def accelerate_launch(python: str) -> list[str]:
    """``accelerate launch`` of ``python``'s venv on one process, with no config file."""
    return [os.path.join(os.path.dirname(python), "accelerate"), "launch", "--num_processes",
            "1", "--num_machines", "1", "--dynamo_backend", "no"]


def source_note(folder: str) -> Optional[str]:
    """The first line of ``folder``'s ``SOURCE`` file that names a commit: where a copy that
    is not a git checkout was taken from."""
    try:
        with open(os.path.join(folder, "SOURCE")) as f:
            return next((line.strip() for line in f if "commit" in line), None)
    except OSError:
        return None


def main_versions() -> str:
    try:
        return check_python(sys.executable, ["numpy", "transformers", "lightning"], "")
    except NotRun as e:
        return str(e)


def tiny_text_dataset(folder: str, chars: int = 200_000) -> None:
    """nanoGPT's character-level dataset (the format of its data/shakespeare_char/prepare.py:
    uint16 ``train.bin``/``val.bin`` split 90/10 and ``meta.pkl`` with the vocabulary) from a
    synthetic text: words of a made-up vocabulary, each followed by one of three others."""
    import numpy as np

    if os.path.exists(os.path.join(folder, "meta.pkl")):
        return
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(200)]
    follow = {w: rng.sample(words, 3) for w in words}
    out: list[str] = []
    word, length = words[0], 0
    while length < chars:
        out.append(word + (".\n" if rng.random() < 0.1 else " "))
        length += len(out[-1])
        word = rng.choice(follow[word])
    data = "".join(out)[:chars]
    vocab = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(vocab)}
    ids = np.array([stoi[c] for c in data], dtype=np.uint16)
    n = int(len(ids) * 0.9)
    ids[:n].tofile(os.path.join(folder, "train.bin"))
    ids[n:].tofile(os.path.join(folder, "val.bin"))
    with open(os.path.join(folder, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": len(vocab), "itos": dict(enumerate(vocab)), "stoi": stoi}, f)


# ---------------------------------------------------------------------------------------------
# running and scoring


def child_env(threads: int) -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = ROOT + os.pathsep + out.get("PYTHONPATH", "")
    out["OMP_NUM_THREADS"] = str(threads)
    out.setdefault("HF_HUB_OFFLINE", "1")  # every row's data and model are in the workdir
    return out


def last_lines(path: str, n: int = 3) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip() for line in f.readlines()[-n:]]
    except OSError:
        return []


def score_one(entry: dict[str, Any], setup: Setup, runs: str, timeout: float,
              threads: int) -> dict[str, Any]:
    """Records and diagnoses one row; the row of the table."""
    name = entry["name"]
    out: dict[str, Any] = {"name": name, "stack": entry["stack"],
                           "kind": "healthy" if entry["expected"] == "healthy" else "failure",
                           "expected": entry["expected"], "accept": entry["accept"],
                           "why": entry["why"], "got": None, "confidence": None,
                           "first_bad": None, "rejected": [], "notes": [], "right": False,
                           "not_run": None, "error": None}
    try:
        stack = setup.get(entry["stack"])
    except NotRun as e:
        out["not_run"] = str(e)
        return out
    fill = {**stack["fill"], "row": name}
    args = [a.format(**fill) for a in entry["args"]]
    if "before" in stack:
        stack["before"](name)
    run = os.path.join(runs, name + ".h5")
    log = os.path.join(runs, name + ".log")
    command = [stack["python"], "-m", "ampdoctor", "record", *entry["record"], "-o", run,
               "--force", "--",
               *stack["command"], *args]
    out["command"] = " ".join(command)
    started = time.monotonic()
    try:
        with open(log, "w") as f:
            done = subprocess.run(command, cwd=stack["cwd"],
                                  env={**child_env(threads), **entry["env"]}, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        out["record_rc"] = done.returncode
        out["seconds"] = round(time.monotonic() - started, 1)
        diag = subprocess.run([sys.executable, "-m", "ampdoctor", "diagnose", run, "--format",
                               "json"], cwd=ROOT, env=child_env(threads), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out["error"] = [f"timed out after {exc.timeout:.0f} s"] + last_lines(log)
        return out
    if diag.returncode != 0:
        out["error"] = (diag.stderr or diag.stdout).strip().splitlines()[-1:] + last_lines(log)
        return out
    if done.returncode != 0:
        out["error"] = [f"the training exited {done.returncode}"] + last_lines(log)
    result = json.loads(diag.stdout)
    out["got"] = result["verdict"]
    out["confidence"] = result["confidence"]
    out["first_bad"] = result.get("first_bad")
    out["summary"] = result.get("summary")
    out["causes"] = [f"{c.get('verdict')} ({c.get('role')}, {c.get('confidence')})"
                     for c in result.get("causes") or []]
    out["evidence"] = [e.get("text") for e in (result.get("evidence") or [])[:4]]
    out["rejected"] = [{"verdict": c.get("verdict"), "confidence": c.get("confidence"),
                        "failed": [f"{p.get('name')}: {p.get('fact')}"
                                   for p in c.get("premises") or []
                                   if p.get("status") == "failed"]}
                       for c in result.get("rejected") or []]
    out["notes"] = [str(n)[:300] for n in result.get("notes") or []]
    out["right"] = result["verdict"] in entry["accept"]
    if entry.get("dose"):
        out["dose"] = treat(entry, result, command, run, stack, timeout, threads)
    return out


def treat(entry: dict[str, Any], result: dict[str, Any], command: list[str], run: str,
          stack: dict[str, Any], timeout: float, threads: int) -> dict[str, Any]:
    """The dose check of a failing row: its prescribed fix recorded and compared
    (``third_party_trainers.dose``), against the healthy row ``entry["dose"]`` of this
    workdir (run it first, or in the same call)."""
    def record(cmd: list[str], log: str) -> int:
        with open(log, "w") as f:
            return subprocess.run(cmd, cwd=stack["cwd"],
                                  env={**child_env(threads), **entry["env"]}, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode

    def cli(args: list[str]) -> tuple[int, str]:
        done = subprocess.run([sys.executable, "-m", "ampdoctor", *args], cwd=ROOT,
                              env=child_env(threads), capture_output=True, text=True,
                              timeout=timeout)
        return done.returncode, done.stdout if done.returncode == 0 else done.stderr

    healthy = os.path.join(os.path.dirname(run), entry["dose"] + ".h5")
    try:
        return trainers.dose(result, command, run, healthy, record, cli)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"timed out after {exc.timeout:.0f} s"}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``blind_score.summary`` (failures right, healthy runs without a false alarm, calibration
    at >= 0.9) over the rows that ran; those that did not count in none of them."""
    ran = [r for r in rows if not r["not_run"]]
    return {**blind_score.summary(ran), "not_run": len(rows) - len(ran)}


def where(r: dict[str, Any]) -> str:
    fb = r["first_bad"] or {}
    if fb.get("step") is None:
        return ""
    text = f"step {fb['step']}"
    if fb.get("module"):
        text += f" {fb['module']} ({fb.get('phase') or ''})"
    return text


def table(rows: list[dict[str, Any]], score: dict[str, Any]) -> str:
    """The Markdown table, then the errors, the score and the calibration line."""
    lines = ["| row | expected (accepted) | got | conf | first bad | right? |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        expected = r["expected"] + "".join(f", {a}" for a in r["accept"] if a != r["expected"])
        if r["not_run"]:
            got, right = f"not run: {r['not_run']}", "—"
        else:
            got = r["got"] or "error (below)"
            right = "right" if r["right"] else "**WRONG**"
        conf = "" if r["confidence"] is None else f"{r['confidence']:.2f}"
        lines.append(f"| {r['name']} | {expected} | {got} | {conf} | {where(r)} | {right} |")
    lines.append("")
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['name']}: {' / '.join(r['error'])[:400]}")
    for r in rows:
        if r.get("dose"):
            lines.append(f"{r['name']} dosed: {dose_line(r['dose'])}")
    lines.append(f"failures right: {score['failures_right']}/{score['failures']}; "
                 f"healthy with no false alarm: {score['healthy_right']}/{score['healthy']}"
                 + (f"; not run: {score['not_run']}" if score["not_run"] else ""))
    lines.append(f"calibration: of {score['confident']} verdicts at confidence >= {blind_score.CONFIDENT}, "
                 f"{score['confident_right']} right")
    return "\n".join(lines)


def dose_line(d: dict[str, Any]) -> str:
    """What the prescribed fix did: ``--apply``, the treated run's verdict, its last losses
    beside the failing and the healthy run's, and what ``compare`` calls it."""
    if not d.get("apply"):
        return d.get("why") or d.get("error") or "no --apply"
    loss = d.get("losses") or {}
    text = f"{d['apply']} -> {d.get('verdict')}"
    parts = [f"{k} {v.get('last5_mean')}" for k, v in loss.items() if v.get("finite")]
    if parts:
        text += "; loss over the last 5 steps: " + ", ".join(parts)
    for key in ("compare_failing", "compare_healthy"):
        if d.get(key):
            text += f"; {key.replace('_', ' ')}: {d[key].get('kind')} {d[key].get('verdict')}"
    return text


def selected(only: Optional[str]) -> list[dict[str, Any]]:
    if only is None:
        return ROWS
    names = only.split(",")
    rows = [r for r in ROWS if r["name"] in names or r["stack"] in names]
    if not rows:
        sys.exit(f"third_party: no row or stack named {only!r} (stacks: {', '.join(STACKS)})")
    return rows


def merge(paths: list[str], out: Optional[str]) -> int:
    """The rows of several ``--out`` files, in ``ROWS`` order, scored again; the environment
    of each file kept under its path."""
    found: dict[str, dict[str, Any]] = {}
    envs = {}
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        found.update({r["name"]: r for r in saved["rows"]})
        envs[path] = saved.get("env")
    order = [e["name"] for e in ROWS]
    rows = sorted(found.values(), key=lambda r: order.index(r["name"]) if r["name"] in order
                  else len(order))
    score = summary(rows)
    print(table(rows, score))
    if out:
        with open(out, "w") as f:
            json.dump({"rows": rows, "score": score, "env": envs}, f, indent=2)
            f.write("\n")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="rows and stacks' rows, comma-separated (stacks: "
                        + ", ".join(STACKS) + ")")
    parser.add_argument("--out", help="write the table and the score to this JSON file")
    parser.add_argument("--workdir", help="build the data and keep the runs here (default: a "
                                          "temp folder)")
    parser.add_argument("--timm-repo", default=TIMM_REPO,
                        help="a checkout or git directory of huggingface/pytorch-image-models")
    parser.add_argument("--nanogpt-repo", default=NANOGPT_REPO,
                        help="a checkout or git directory of karpathy/nanoGPT")
    parser.add_argument("--side-python", default=SIDE_PYTHON,
                        help="the python with torchvision, timm and open_clip (see the top of "
                             "this file)")
    parser.add_argument("--tp-python", default=TP_PYTHON,
                        help="the python with litgpt and torchtune (see the top of this file)")
    parser.add_argument("--tv-python", default=TV_PYTHON,
                        help="the python with torchvision, diffusers and accelerate (see the "
                             "top of this file)")
    parser.add_argument("--diffusers-repo", default=DIFFUSERS_REPO,
                        help="a checkout or git directory of huggingface/diffusers")
    parser.add_argument("--transformers-repo", default=TRANSFORMERS_REPO,
                        help="a checkout or git directory of huggingface/transformers, or a "
                             "folder with " + CLM_SCRIPT)
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of the training processes (1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per command")
    parser.add_argument("--show", help="print the table of a result file written by --out")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="merge result files written by --out (a row in a later file "
                             "replaces the same row in an earlier one) into --out")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.show:
        with open(args.show) as f:
            saved = json.load(f)
        print(table(saved["rows"], saved["score"]))
        return 0
    entries = selected(args.only)
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="third_party_"))
    runs = os.path.join(workdir, "runs")
    os.makedirs(runs, exist_ok=True)
    setup = Setup(args, workdir)
    started = time.monotonic()
    rows = []
    for entry in entries:  # one training process at a time
        rows.append(score_one(entry, setup, runs, args.timeout, args.threads))
        r = rows[-1]
        state = (f"not run: {r['not_run']}" if r["not_run"] else
                 f"{r['got']} {r['confidence']} ({'right' if r['right'] else 'WRONG'}, "
                 f"{r.get('seconds')} s)")
        print(f"third_party: {r['name']}: {state}", file=sys.stderr, flush=True)
    score = summary(rows)
    print(table(rows, score))
    if args.out:
        side = setup.info.get("side")
        env: dict[str, Any] = {
            "python": sys.version.split()[0], "side_python": args.side_python,
            "side": None if side is None else str(side),
            "timm_repo": args.timm_repo, "timm_commit": setup.info.get("timm_commit"),
            "nanogpt_repo": args.nanogpt_repo,
            "nanogpt_commit": setup.info.get("nanogpt_commit"),
            "tp_python": args.tp_python, "tp": str(setup.info.get("tp")),
            "tv_python": args.tv_python, "tv": str(setup.info.get("tv")),
            "diffusers_repo": args.diffusers_repo,
            "diffusers_commit": setup.info.get("diffusers_commit"),
            "transformers_repo": args.transformers_repo,
            "transformers_commit": setup.info.get("transformers_commit"),
            "main": main_versions(), "threads": args.threads, "wall_s": round(time.monotonic() - started, 1)}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "score": score, "env": env}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
