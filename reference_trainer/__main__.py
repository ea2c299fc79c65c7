from .cli import train_command

if __name__ == "__main__":
    train_command(prog_name="python -m reference_trainer")
