"""Models out of the pipeline: `hf_model[run]`, a run's checkpoint in Hugging Face format."""
