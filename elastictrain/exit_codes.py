"""The exit codes of ``elastictrain run`` (the README's Operations table), in a module that imports nothing,
so the command line can exit with them before it imports torch."""

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_CHECKPOINT, EXIT_PREEMPTED = 0, 1, 2, 3, 75
