"""The weight path, both sides: trainer rank 0 packs and sends each policy version, the
rollouts receive and load it into vLLM (ipc, nccl or zmq backends; LoRA adapters).

Modules:
* `backend`: Which weight-sync backend a run uses (`weight_sync.backend`), decided by trainer
  rank 0 once it knows its rollouts.
* `errors`: The weight path's errors, shared by both sides.
* `group`: Weight broadcast over a dedicated process group: the `nccl` weight-sync backend's
  data plane.
* `ipc`: CUDA IPC handles for the `ipc` weight-sync backend: a buffer on the trainer's GPU
  shared with the vLLM worker on the same GPU, with no copy.
* `layout`: The one tensor layout every weight-sync backend shares: named tensors of a bucket
  laid out in one flat uint8 buffer (`wire.TensorSlot` says where each lies).
* `lora_adapters`: LoRA adapters on the weight path (`trainer.lora.rank > 0`).
* `lora_worker`: Inside a vLLM worker: a policy version's LoRA adapter, registered from tensors.
* `receiver`: A rollout's side of every weight-sync backend: the requests on its weights socket.
* `sender`: Trainer rank 0's side of every weight-sync backend: one version to every rollout.
* `staging`: Staging of one policy version's weight buckets in shared memory.
* `transfers`: How one bucket reaches one rollout, per weight-sync backend (see sender.py).
* `vllm_reload`: vLLM's layerwise reload as the weight updates use it (inside the engine's
  workers).
* `worker_calls`: The calls the rollout's engine wrapper (roles/generation/engine.py) and the
  weight receiver (roles/weights/receiver.py) make into vLLM's workers, by name, through
  `collective_rpc`: each is a method of `TandemWorkerExtension` (roles/weights/worker_ext.py),
  which vLLM mixes into its worker class.
* `worker_ext`: vLLM worker extension (`worker_extension_cls`): in-place weight loading inside
  the engine's worker processes, called through `collective_rpc("tandem_...")`.
"""
