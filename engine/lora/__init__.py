"""LoRA adapters on a Llama-3 target (issue 40): PEFT's files read and checked
(``adapter``), and their deltas over a batch whose rows each use one adapter or none
(``ops``)."""
