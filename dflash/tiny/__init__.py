"""The shipped tiny byte-level pair: tokenizer (:mod:`.tokenizer`), stdlib corpus (:mod:`.corpus`),
target pretraining (:mod:`.pretrain`), loaders of the shipped weights (:mod:`.models`, :mod:`.pair`)."""
