"""Example Tasks a job spec can name, e.g. `task: {name: "examples.plugins.my_task:MyTask"}`."""
