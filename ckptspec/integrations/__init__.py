"""Where users train: the save and resume hooks of training frameworks, imported only by their users.

``transformers`` (a ``TrainerCallback`` and the resume check of ``Trainer.train``) imports transformers, and
torch inside its functions; nothing in ckptspec imports this package, so installing ckptspec needs neither.
"""
