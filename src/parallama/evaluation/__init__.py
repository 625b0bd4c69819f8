"""Downstream evaluation: lm-eval's model over any checkpoint or the training model (`lm`), running its tasks
(`harness`), the periodic evaluation during training (`callback`) and parallama's embedded tasks (`tasks/`)."""
