"""Example plug-ins a job spec can name with `entrypoint: "examples.plugins.my_model:..."`."""
