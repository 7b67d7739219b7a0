"""Packaging reads settings.ini, nbdev's single source for the name, version and requirements."""
from configparser import ConfigParser
from setuptools import find_packages, setup

cfg = ConfigParser(delimiters=["="])
cfg.read("settings.ini", encoding="utf-8")
cfg = cfg["DEFAULT"]

setup(
    name=cfg["repo"],
    version=cfg["version"],
    description=cfg["description"],
    author=cfg["author"],
    license="Apache-2.0",
    python_requires=">=" + cfg["min_python"],
    packages=find_packages(include=[cfg["lib_name"], cfg["lib_name"] + ".*"]),
    install_requires=cfg["requirements"].split(),
    extras_require={"dev": cfg["dev_requirements"].split()},
    entry_points={
        "console_scripts": cfg["console_scripts"].split(),
        "nbdev": [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
    zip_safe=False,
)
