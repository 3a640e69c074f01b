"""The planner: policy search on the twin (search), calibration of the twin from the runtime
(calibrate), and validation of twin against runtime (validate). CLI glue in planner/cli.py."""
