error: cluster file 'ff.yaml' does not exist; pass the path of a YAML file.
