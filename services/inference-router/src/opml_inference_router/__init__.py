"""Inference router (after Microsoft's Deep Learning Inference Service, DeepCPU and Google's ML
accelerators): serves ONNX models from bundles on pools of CPU, GPU and accelerator workers.

``placement`` is the transport-free "model master": model and pool-kind configuration, profiles,
the latency model, placement policies, the planner and capacity-safe moves. ``sim`` runs that same
code over a synthetic fleet and checks the result with a discrete-event simulation.
"""
