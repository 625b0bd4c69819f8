"""The Llama family: its config, the model, attention masks, Hugging Face conversion and its parallelize plan."""
