"""What the LLM and diffusion trainers of ``benchmarks/third_party.py`` need, built offline in
its workdir: litgpt's tokenizer, text files and pretraining config, a tiny random litgpt
checkpoint (made with litgpt's own API) to finetune, a folder of 16 px images for diffusers'
``train_unconditional.py`` with its UNet config, a captioned image folder and a tiny random
Stable Diffusion folder (made with diffusers' and transformers' own classes) for its
``train_text_to_image.py``, a tiny random Llama checkpoint for torchtune's
recipe, and a text corpus with a tokenizer and a GPT-2 config for transformers'
``run_clm_no_trainer.py`` (an accelerate loop); and the dose check: a failing row's prescribed
``--apply`` recorded on the same command, and compared with the failing and the healthy run.

Each builder runs once per workdir (a ``.done`` file) and returns the folder it filled. Code
that needs the trainers' own packages (litgpt, torchtune's checkpoint format) runs in the side
python (``--tp-python``), as a ``-c`` program: nothing here imports them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from typing import Any, Callable, Optional

WORDS_SEED = 0


class NotRun(Exception):
    """A row cannot run here; the message says why in one sentence."""


def corpus(n_words: int = 40_000, seed: int = WORDS_SEED) -> list[str]:
    """Lines of a made-up language: 200 words, each followed by one of three others (the text
    of nanoGPT's rows, cut into sentences)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(200)]
    follow = {w: rng.sample(words, 3) for w in words}
    lines, line, word = [], [], words[0]
    for _ in range(n_words):
        line.append(word)
        if len(line) >= 12 and rng.random() < 0.2:
            lines.append(" ".join(line))
            line = []
        word = rng.choice(follow[word])
    return lines


def once(folder: str, build: Callable[[str], None]) -> str:
    done = os.path.join(folder, ".done")
    if not os.path.exists(done):
        os.makedirs(folder, exist_ok=True)
        build(folder)
        open(done, "w").close()
    return folder


def side_run(python: str, code: str, env: dict[str, str], what: str) -> None:
    """Runs ``code`` in the side python; a failure is the row's "not run" reason."""
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                          timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise NotRun(f"building {what} failed: {last[:200]}")


def tokenizer(folder: str, lines: list[str], vocab: int = 384) -> None:
    """A byte-level BPE ``tokenizer.json`` trained on ``lines`` (Hugging Face tokenizers, as
    litgpt and transformers load it), with the config files that name its special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "model_max_length": 64, "tokenizer_class": "PreTrainedTokenizerFast",
                   "add_bos_token": False}, f)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)


# litgpt: a pythia-like (GPT-NeoX) model of 2 layers, 64 wide
LITGPT_MODEL = {"name": "tiny-neox", "hf_config": {"org": "local", "name": "tiny-neox"},
                "block_size": 64, "vocab_size": 384, "padded_vocab_size": 384, "n_layer": 2,
                "n_head": 2, "n_embd": 64, "rotary_percentage": 0.25, "parallel_residual": True,
                "bias": True, "norm_class_name": "LayerNorm", "mlp_class_name": "GptNeoxMLP",
                "intermediate_size": 256}


def litgpt(folder: str, python: str, env: dict[str, str]) -> str:
    """``tokenizer/``, ``text/train`` and ``text/val`` (litgpt's ``TextFiles``),
    ``pretrain_lrLR.yaml`` (``pretrain_config``) and ``checkpoint/`` (the model's random weights saved by litgpt's ``GPT``, with
    ``model_config.yaml`` and the tokenizer: what ``finetune_full`` loads)."""
    def build(folder: str) -> None:
        lines = corpus()
        tok = os.path.join(folder, "tokenizer")
        os.makedirs(tok, exist_ok=True)
        tokenizer(tok, lines)
        for split, part in (("train", lines[:-200]), ("val", lines[-200:])):
            d = os.path.join(folder, "text", split)
            os.makedirs(d, exist_ok=True)
            step = max(1, len(part) // 4) if split == "train" else len(part)
            for i in range(0, len(part), step):
                with open(os.path.join(d, f"{i // step}.txt"), "w") as f:
                    f.write("\n".join(part[i:i + step]) + "\n")
        checkpoint = os.path.join(folder, "checkpoint")
        os.makedirs(checkpoint, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            with open(os.path.join(tok, name)) as src, \
                    open(os.path.join(checkpoint, name), "w") as dst:
                dst.write(src.read())
        side_run(python, LITGPT_CHECKPOINT.format(config=LITGPT_MODEL, out=checkpoint), env,
                 "the litgpt checkpoint")
    once(folder, build)
    for lr in PRETRAIN_LRS:
        with open(os.path.join(folder, f"pretrain_lr{lr:g}.yaml"), "w") as f:
            json.dump(pretrain_config(folder, lr), f, indent=1)
    return folder


# one config file per LR: jsonargparse cannot override a config's optimizer from the command
# line (a whole --optimizer raises AttributeError in litgpt 0.5.13; --optimizer.init_args.lr
# adds a top-level key that AdamW never reads)
PRETRAIN_LRS = (3e-3, 10.0, 3e-5)


def pretrain_config(folder: str, lr: float) -> dict[str, Any]:
    """``litgpt pretrain --config``: the model, the data and the training flags, as litgpt's
    own ``config_hub/pretrain`` files are written, with AdamW at ``lr``."""
    return {
        "model_name": "tiny-neox", "model_config": LITGPT_MODEL,
        "out_dir": os.path.join(folder, "out"),
        "tokenizer_dir": os.path.join(folder, "tokenizer"),
        "data": {"class_path": "litgpt.data.TextFiles",
                 "init_args": {"train_data_path": os.path.join(folder, "text", "train"),
                               "val_data_path": os.path.join(folder, "text", "val"),
                               "num_workers": 0}},
        "train": {"save_interval": 100000, "log_interval": 1, "global_batch_size": 8,
                  "micro_batch_size": 8, "max_tokens": 8 * 64 * 40, "max_seq_length": 64,
                  "lr_warmup_steps": 4, "max_norm": 1.0, "min_lr": min(lr, 1e-4),
                  "tie_embeddings": False},
        "eval": {"interval": 100000, "max_iters": 1, "initial_validation": False,
                 "final_validation": False},
        "optimizer": {"class_path": "torch.optim.AdamW",
                      "init_args": {"lr": lr, "weight_decay": 0.1, "betas": [0.9, 0.95]}},
        "devices": 1, "logger_name": "csv", "seed": 42}


LITGPT_CHECKPOINT = """
import torch, yaml
from dataclasses import asdict
from litgpt import Config, GPT
torch.manual_seed(0)
config = Config(**{config!r})
torch.save(GPT(config).state_dict(), {out!r} + "/lit_model.pth")
with open({out!r} + "/model_config.yaml", "w") as f:
    yaml.dump(asdict(config), f)
"""


def finetune_data(folder: str) -> str:
    """A JSON instruction dataset (litgpt's ``JSON`` data module): copy the first word."""
    def build(folder: str) -> None:
        rng = random.Random(1)
        rows = []
        for line in corpus(8000, seed=2):
            words = line.split()
            rows.append({"instruction": "Repeat the first word.", "input": " ".join(words[:8]),
                         "output": words[0]})
        rng.shuffle(rows)
        with open(os.path.join(folder, "train.json"), "w") as f:
            json.dump(rows[:-40], f)
        with open(os.path.join(folder, "val.json"), "w") as f:
            json.dump(rows[-40:], f)
    return once(folder, build)


# diffusers' UNet2DModel, as small as its blocks allow: 16 px, two resolutions, 32 channels
UNET = {"_class_name": "UNet2DModel", "sample_size": 16, "in_channels": 3, "out_channels": 3,
        "layers_per_block": 1, "block_out_channels": [32, 64], "norm_num_groups": 8,
        "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
        "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "attention_head_dim": 8}


def diffusers(folder: str, make_images: Callable[..., str]) -> str:
    """``images/`` (16 px, an ImageFolder ``datasets`` reads) and ``unet/config.json``."""
    def build(folder: str) -> None:
        make_images(os.path.join(folder, "images"), per_class=16, val_per_class=0, size=16)
        os.makedirs(os.path.join(folder, "unet"), exist_ok=True)
        with open(os.path.join(folder, "unet", "config.json"), "w") as f:
            json.dump(UNET, f, indent=1)
    return once(folder, build)


# diffusers' examples/text_to_image/train_text_to_image.py loads a whole Stable Diffusion
# folder (--pretrained_model_name_or_path): CLIP's tokenizer and text encoder, a VAE, a
# conditional UNet and a DDPM scheduler. Each here is as small as its blocks allow: a CLIP BPE
# of the byte alphabet plus the captions' words, a 2-layer CLIP text encoder 32 wide, a VAE of
# two resolutions (16 px images to 8x8x4 latents), a UNet of two resolutions (16 and 32
# channels, cross-attention 32 wide: the text encoder's width), saved with diffusers' own
# StableDiffusionPipeline.save_pretrained
T2I_BUILD = """
import torch
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

# CLIP's byte-level alphabet: printable bytes as themselves, the rest shifted past 255
keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
chars = [chr(b) for b in keep] + [chr(256 + i) for i in range(256 - len(keep))]
tokens = chars + [c + "</w>" for c in chars]
merges = []
for word in {words!r}:
    parts = list(word[:-1]) + [word[-1] + "</w>"]
    while len(parts) > 1:
        merges.append((parts[0], parts[1]))
        parts = [parts[0] + parts[1]] + parts[2:]
        if parts[0] not in tokens:
            tokens.append(parts[0])
tokens += ["<|startoftext|>", "<|endoftext|>"]
vocab = {{t: i for i, t in enumerate(tokens)}}
tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=16)
torch.manual_seed(0)
text_encoder = CLIPTextModel(CLIPTextConfig(
    vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, max_position_embeddings=16, bos_token_id=vocab["<|startoftext|>"],
    eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"]))
vae = AutoencoderKL(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
    down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    layers_per_block=1, norm_num_groups=4, sample_size=16)
unet = UNet2DConditionModel(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
    norm_num_groups=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
    attention_head_dim=8)
scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                          beta_schedule="scaled_linear", clip_sample=False, steps_offset=1)
StableDiffusionPipeline(
    vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
    safety_checker=None, feature_extractor=None, requires_safety_checker=False,
).save_pretrained({out!r})
"""


def text_to_image(folder: str, python: str, env: dict[str, str],
                  make_images: Callable[..., str], colors: list[str]) -> str:
    """``images/train`` (16 px, one colour per class, with the ``metadata.jsonl`` captions
    column ``text``: "a photo of red noise", an imagefolder ``datasets`` reads) and ``model/``
    (``T2I_BUILD``: the folder ``--pretrained_model_name_or_path`` names)."""
    def build(folder: str) -> None:
        images = make_images(os.path.join(folder, "images"), per_class=16, val_per_class=0,
                             size=16)
        with open(os.path.join(images, "train", "metadata.jsonl"), "w") as f:
            for c, color in enumerate(colors):
                for i in range(16):
                    f.write(json.dumps({"file_name": f"class{c}/{i}.png",
                                        "text": f"a photo of {color} noise"}) + "\n")
        words = sorted({w for color in colors for w in f"a photo of {color} noise".split()})
        side_run(python, T2I_BUILD.format(words=words, out=os.path.join(folder, "model")), env,
                 "the tiny Stable Diffusion folder")
    return once(folder, build)


# transformers' run_clm_no_trainer.py: a GPT-2 of 2 layers, 64 wide, from a config (the script
# trains it from scratch: no --model_name_or_path); "dtype" is the config key the script's
# AutoModelForCausalLM.from_config builds the weights in
CLM_MODEL = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 384,
             "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 2, "bos_token_id": 1,
             "eos_token_id": 2, "tie_word_embeddings": True}


def clm(folder: str) -> str:
    """``train.txt`` (the script's ``--train_file``: it holds back 5 % for validation), and
    ``gpt2/`` and ``gpt2_bf16/`` (``--config_name`` and ``--tokenizer_name``: a GPT-2
    ``config.json``, fp32 and with ``"dtype": "bfloat16"``, beside the byte-level BPE
    tokenizer)."""
    def build(folder: str) -> None:
        lines = corpus()
        with open(os.path.join(folder, "train.txt"), "w") as f:
            f.write("\n".join(lines[:1500]) + "\n")
        for name, extra in (("gpt2", {}), ("gpt2_bf16", {"dtype": "bfloat16"})):
            d = os.path.join(folder, name)
            os.makedirs(d, exist_ok=True)
            tokenizer(d, lines)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump({**CLM_MODEL, **extra}, f, indent=1)
    return once(folder, build)


# ---------------------------------------------------------------------------------------------
# the dose check


def fix_args(result: dict[str, Any]) -> list[str]:
    """The ``--apply`` arguments of the diagnosis's first fix that has them."""
    for fix in result.get("fixes") or []:
        apply = fix.get("apply")
        if apply:
            out: list[str] = []
            for a in apply if isinstance(apply, list) else [apply]:
                out += ["--apply", str(a)]
            return out
    return []


def losses(path: str) -> dict[str, Any]:
    """A run's first and last finite loss and the mean of its last five steps' losses."""
    import numpy as np

    import ampdoctor

    loss = np.asarray(ampdoctor.load(path).steps["loss"], dtype=float)
    finite = loss[np.isfinite(loss)]
    if not len(finite):
        return {"steps": len(loss), "finite": 0}
    return {"steps": len(loss), "finite": int(len(finite)), "first": round(float(finite[0]), 4),
            "last": round(float(finite[-1]), 4),
            "last5_mean": round(float(np.mean(loss[-5:])), 4)}


def dose(result: dict[str, Any], command: list[str], run: str, healthy: Optional[str],
         record: Callable[[list[str], str], int],
         cli: Callable[[list[str]], tuple[int, str]]) -> dict[str, Any]:
    """Records ``command`` (``... record -o RUN ... -- TRAINER``) again with the diagnosis's
    ``--apply`` as ``RUN.treated.h5``; the fix, the treated run's verdict and losses beside the
    failing and the healthy run's, and ``compare``'s verdict of failing -> treated and of
    healthy -> treated."""
    args = fix_args(result)
    info: dict[str, Any] = {"apply": " ".join(args) or None,
                            "fix": [f.get("text") or f.get("title") for f in
                                    (result.get("fixes") or [])[:1]]}
    if not args:
        info["why"] = "the diagnosis offers no --apply"
        return info
    treated = run[:-3] + ".treated.h5"
    at = command.index("-o")
    info["record_rc"] = record(command[:at] + args + ["-o", treated] + command[at + 2:],
                               treated[:-3] + ".log")
    info["command"] = " ".join(command[:at] + args + ["-o", treated] + command[at + 2:])
    rc, text = cli(["diagnose", treated, "--format", "json"])
    if rc == 0:
        r = json.loads(text)
        info["verdict"], info["confidence"] = r["verdict"], r["confidence"]
        info["next_apply"] = " ".join(fix_args(r)) or None
    info["losses"] = {"failing": losses(run), "treated": losses(treated)}
    if healthy and os.path.exists(healthy):
        info["losses"]["healthy"] = losses(healthy)
    for key, first in (("compare_failing", run), ("compare_healthy", healthy)):
        if first and os.path.exists(first):
            rc, text = cli(["compare", first, treated, "--format", "json"])
            if rc == 0:
                c = json.loads(text)
                info[key] = {"kind": c.get("kind"), "verdict": c.get("verdict")}
            else:
                info[key] = {"error": text.strip().splitlines()[-1:]}
    return info


# torchtune: a Llama-2 architecture of 2 layers, 64 wide, in torchtune's own checkpoint format
TUNE_MODEL = {"_component_": "torchtune.models.llama2.llama2", "vocab_size": 384,
              "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "embed_dim": 64,
              "max_seq_len": 64, "intermediate_dim": 128}


def torchtune(folder: str, python: str, env: dict[str, str]) -> str:
    """``tokenizer.model`` (a SentencePiece BPE, as torchtune's ``llama2_tokenizer`` loads),
    ``train.txt`` (``text_completion_dataset``), ``ckpt/model.pt`` (the random model's state,
    saved from torchtune's own builder) and ``tune.yaml``: the keys of the recipe's shipped
    ``llama2/7B_full_low_memory.yaml``, on CPU, with AdamW and no activation offloading."""
    def build(folder: str) -> None:
        lines = corpus()
        with open(os.path.join(folder, "train.txt"), "w") as f:
            f.write("\n".join(lines[:1200]) + "\n")
        os.makedirs(os.path.join(folder, "ckpt"), exist_ok=True)
        side_run(python, TUNE_BUILD.format(folder=folder, model=TUNE_MODEL), env,
                 "the torchtune checkpoint and tokenizer")
        out = os.path.join(folder, "out")
        config = {
            "output_dir": out,
            "tokenizer": {"_component_": "torchtune.models.llama2.llama2_tokenizer",
                          "path": os.path.join(folder, "tokenizer.model"), "max_seq_len": 64},
            "dataset": {"_component_": "torchtune.datasets.text_completion_dataset",
                        "source": "text", "data_files": os.path.join(folder, "train.txt"),
                        "split": "train", "column": "text"},
            "seed": 0, "shuffle": True, "model": TUNE_MODEL,
            "checkpointer": {"_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                             "checkpoint_dir": os.path.join(folder, "ckpt"),
                             "checkpoint_files": ["model.pt"], "recipe_checkpoint": None,
                             "output_dir": out, "model_type": "LLAMA2"},
            "resume_from_checkpoint": False, "batch_size": 8, "epochs": 1,
            "max_steps_per_epoch": 30,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
            "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
            "gradient_accumulation_steps": 1, "optimizer_in_bwd": False,
            "clip_grad_norm": None, "compile": False, "device": "cpu",
            "enable_activation_checkpointing": False, "enable_activation_offloading": False,
            "dtype": "fp32",
            "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                              "log_dir": os.path.join(out, "logs")},
            "log_every_n_steps": 1, "log_peak_memory_stats": False,
            "profiler": {"_component_": "torchtune.training.setup_torch_profiler",
                         "enabled": False}}
        with open(os.path.join(folder, "tune.yaml"), "w") as f:
            json.dump(config, f, indent=1)
    return once(folder, build)


TUNE_BUILD = """
import torch, sentencepiece
from torchtune.config import instantiate
from omegaconf import OmegaConf
sentencepiece.SentencePieceTrainer.train(
    input={folder!r} + "/train.txt", model_prefix={folder!r} + "/tokenizer", vocab_size=384,
    model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1)
torch.manual_seed(0)
model = instantiate(OmegaConf.create({model!r}))
torch.save(model.state_dict(), {folder!r} + "/ckpt/model.pt")
"""
