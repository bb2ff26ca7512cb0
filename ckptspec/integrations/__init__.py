"""Where users train: the save and resume hooks of training frameworks, imported only by their users.

``transformers`` (a ``TrainerCallback`` and the resume check of ``Trainer.train``) imports transformers;
``accelerate`` (``save_state`` and ``load_state`` around the accelerator's own) imports nothing of accelerate. Both
import torch inside their functions; nothing in ckptspec imports this package, so installing ckptspec needs none.
"""
