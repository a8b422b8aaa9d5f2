"""Step 3 of an update: scoring sampled sequences under the policy, the critic and the reference (`scorer.py`), and
log-probs of the responses from logits (`logprobs.py`)."""
