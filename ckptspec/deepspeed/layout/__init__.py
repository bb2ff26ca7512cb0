"""Layout: DeepSpeed's on-disk layout (file names, tag directories, parallel files, legacy layouts, where
masters and states sit in the pickles). It reads files and names; it builds no document."""
