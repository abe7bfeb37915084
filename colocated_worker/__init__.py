"""Co-located worker: a prefill and a decode worker in one process over one engine, the KV
handed from one to the other in place."""
