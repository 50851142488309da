"""Compiling by blocks: the blocks a model repeats, one compiled region per distinct block, and which
regions stay compiled.

`blocks.py` (finding blocks, grouping identical ones into regions), `regional_compile.py` (each
region's compiled entry and the routing of its blocks' calls), `region_choice.py` (compiled or eager,
by measurement), `fusible.py` (a graph with nothing for Inductor to fuse), `glue.py` (the code between
blocks as regions of its own) and `background.py` (lowering regions on a thread of the model's while its
blocks run eagerly).
"""
