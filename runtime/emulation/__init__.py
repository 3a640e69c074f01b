"""The emulated cluster: each worker process given the hardware of the scenario node it stands for."""
