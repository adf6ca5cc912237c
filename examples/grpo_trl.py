"""GRPO with TRL's GRPOTrainer, its log-prob computations routed to torch_fused.

    pip install -e '.[trl]'          # TRL 1.13.0, 1.14.2 or 1.16.0, transformers, datasets, accelerate
    python examples/grpo_trl.py --model Qwen/Qwen2.5-0.5B-Instruct
    python examples/grpo_trl.py --tiny --max-steps 2      # offline: a tiny random model, on CPU

--model is any causal LM on the Hugging Face Hub or a local path (downloaded by transformers on
first use); --dataset any dataset with a "prompt" column (default trl-lib/tldr, as in TRL's GRPO
quick start). The reward prefers completions of about --target-length characters, a toy reward so
that the script runs as it is; put your reward functions in its place.

What patch() changes: TRL's selective_log_softmax, entropy_from_logits and
selective_log_softmax_and_entropy (where the installed TRL has them) become the fused ops. In TRL
1.16 GRPOTrainer computes every log-prob through its chunked lm_head, which patch() routes to
torch_fused.linear_logprobs_and_entropy (faster than TRL's head, with a fraction of its memory:
docs/BENCHMARKS.md); --no-fused-lm-head leaves that head to TRL. With TRL 1.13 and 1.14
GRPOTrainer works on materialized logits, and patch() routes them. patch() prints one line
saying what it routed and what it left to TRL.

The trainer writes under --output-dir, or a new temporary folder (printed at the start) when it
is not given; the working directory is left alone. The script ends by checking that every logged
loss is finite, and raises otherwise.
"""

import argparse
import math
import tempfile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct",
                   help="Hub model name or local path of a causal LM (default: %(default)s)")
    p.add_argument("--dataset", default="trl-lib/tldr",
                   help="Hub dataset with a 'prompt' column (default: %(default)s)")
    p.add_argument("--tiny", action="store_true",
                   help="no download: a tiny random Qwen2 and a word-level tokenizer built here, a few prompts (CPU)")
    p.add_argument("--no-fused-lm-head", dest="fused_lm_head", action="store_const", const=False, default=None,
                   help="leave TRL's chunked lm_head to TRL (default: routed wherever TRL has the form it adapts)")
    p.add_argument("--no-patch", action="store_true", help="TRL's own path, for comparison")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="per device; a multiple of --num-generations")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--target-length", type=int, default=40, help="the toy reward's preferred completion length")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where GRPOTrainer writes its files (default: a new temporary folder, printed at "
                        "the start)")
    p.add_argument("--cpu", action="store_true", help="train on CPU even where CUDA is present")
    return p.parse_args(argv)


def tiny_model_and_tokenizer():
    """A random 2-layer Qwen2 (vocab 256) and a word-level tokenizer over w0..w252: no download."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(253)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg), tokenizer


def main(argv=None):
    args = parse_args(argv)

    import torch
    try:
        from datasets import Dataset, load_dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"{e}: this example needs TRL and its dependencies: pip install -e '.[trl]'") from e

    from torch_fused.integrations import trl as tf_trl

    def reward_len(completions, **kwargs):
        return [-abs(args.target_length - len(c)) / args.target_length for c in completions]

    if args.tiny:
        model, tokenizer = tiny_model_and_tokenizer()
        train = Dataset.from_dict({"prompt": [" ".join(f"w{(7 * i + j) % 250}" for j in range(1 + i % 5))
                                              for i in range(64)]})
    else:
        model, tokenizer = args.model, None  # GRPOTrainer loads both
        train = load_dataset(args.dataset, split="train")

    use_cpu = args.cpu or not torch.cuda.is_available()
    output_dir = args.output_dir if args.output_dir is not None else tempfile.mkdtemp(prefix="grpo_trl_")
    print(f"output directory: {output_dir}", flush=True)
    config = GRPOConfig(
        output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=use_cpu, bf16=not use_cpu,  # TRL defaults to bf16 autocast, slow on CPU
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=config, train_dataset=train,
                          processing_class=tokenizer)

    patched = []
    if args.no_patch:
        trainer.train()
    else:
        # before or after building the trainer: patch() replaces the names in every loaded trl module
        with tf_trl.patched(fused_lm_head=args.fused_lm_head):
            patched = tf_trl.patched_names()
            print("torch_fused in place of:", *patched, sep="\n  ")
            trainer.train()
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    print(f"{len(losses)} steps, loss per step: {', '.join(f'{x:.4f}' for x in losses)}")
    if not losses or not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"expected a finite loss at every logged step, got {losses}")
    return dict(losses=losses, patched=patched)


if __name__ == "__main__":
    main()
