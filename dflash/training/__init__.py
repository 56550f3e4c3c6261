"""Drafter training: the block training step and trainer CLI (:mod:`.train`), the training data (:mod:`.data`)."""
