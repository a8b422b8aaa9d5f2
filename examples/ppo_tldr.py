"""PPO for TL;DR summarization with a learned reward model, in the shape of TRL 1.12's
`trl/experimental/ppo/ppo_tldr.py`.

The script is TRL's with one changed import (`from klppo import PPOConfig, PPOTrainer`); the lines marked
"klppo:" also let it run offline. The reward model shares the policy's tokenizer, so it scores the policy's token
ids directly, as in TRL.

On a GPU, with the hub (TRL's own command):

    python examples/ppo_tldr.py \
        --dataset_name trl-lib/tldr \
        --dataset_test_split validation \
        --output_dir pythia-1b-deduped-tldr-preference-sft-trl-style-ppo \
        --per_device_train_batch_size 1 \
        --gradient_accumulation_steps 64 \
        --total_episodes 30000 \
        --model_name_or_path EleutherAI/pythia-1b-deduped \
        --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr \
        --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr \
        --missing_eos_penalty 1.0 \
        --stop_token eos \
        --response_length 53 \
        --eval_strategy steps \
        --eval_steps 100

Offline: `--dataset_name klppo:tldr` builds summarization prompts ("<passage>\nTL;DR:") from Python's own help
texts, and `klppo:` model ids name klppo's shipped models (a learned reward model needs the hub or a local folder;
any one-output sequence classifier with the policy's tokenizer will do):

    python examples/ppo_tldr.py --dataset_name klppo:tldr --output_dir outputs/ppo-tldr-offline \
        --model_name_or_path klppo:smollm2-135m-instruct --sft_model_path klppo:smollm2-135m-instruct \
        --reward_model_path <a local reward model folder> --per_device_train_batch_size 8 \
        --total_episodes 64 --response_length 24 --stop_token eos --missing_eos_penalty 1.0
"""

import shutil

import torch
from accelerate import PartialState
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser
from trl import ModelConfig, ScriptArguments, get_peft_config, get_quantization_config

from klppo import PPOConfig, PPOTrainer
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
    if script_args.dataset_name == "klppo:tldr":  # klppo: offline summarization prompts
        from datasets import Dataset

        from klppo.data import pydoc_passages

        passages = [f"{p}\nTL;DR:" for p in pydoc_passages(max_chars=400)]
        dataset = {
            "train": Dataset.from_dict({"prompt": passages[:-64]}),
            "validation": Dataset.from_dict({"prompt": passages[-64:]}),
        }
    else:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    train_dataset = dataset[script_args.dataset_train_split]
    eval_dataset = dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None

    def prepare_dataset(dataset, tokenizer):
        """pre-tokenize the dataset before training; only collate during training"""

        def tokenize(element):
            input_ids = tokenizer(element["prompt"], padding=False)["input_ids"]
            return {"input_ids": input_ids, "lengths": len(input_ids)}

        return dataset.map(tokenize, remove_columns=dataset.column_names, num_proc=training_args.dataset_num_proc)

    with PartialState().local_main_process_first():
        train_dataset = prepare_dataset(train_dataset, tokenizer)
        if eval_dataset is not None:
            eval_dataset = prepare_dataset(eval_dataset, tokenizer)
        # filtering
        train_dataset = train_dataset.filter(lambda x: x["lengths"] <= 512, num_proc=training_args.dataset_num_proc)
        if eval_dataset is not None:
            eval_dataset = eval_dataset.filter(lambda x: x["lengths"] <= 512, num_proc=training_args.dataset_num_proc)

    assert train_dataset[0]["input_ids"][-1] != tokenizer.eos_token_id, "The last token should not be an EOS token"

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
