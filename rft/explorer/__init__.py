"""The explorer: generates rollouts with vLLM, scores them with a reward and writes experience."""
