"""Backend adapters, one module per backend (shipped as dpcompare.adapters).

Nothing else lives here. Each module imports its backend's runtime inside the adapter, so importing this
package (or listing backends) never imports Horovod or DeepSpeed.
"""
